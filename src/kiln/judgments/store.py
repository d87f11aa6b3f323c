"""Durable judgments: ``judgments.sqlite3`` under ``eval.eval_dir`` (WAL, ``synchronous=FULL``, file
0600, directory 0700), one row per recorded A/B preference, in insertion order.

Standard library only.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

from kiln.errors import NotFound
from kiln.system.private_sqlite import LockedSQLite, open_private_sqlite

FILE_NAME = "judgments.sqlite3"
FIELDS = ("id", "prompt", "response_a", "response_b", "preferred", "rationale", "author", "created_at")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS judgments (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    prompt TEXT NOT NULL,
    response_a TEXT NOT NULL,
    response_b TEXT NOT NULL,
    preferred TEXT NOT NULL CHECK (preferred IN ('a', 'b', 'tie')),
    rationale TEXT,
    author TEXT,
    created_at REAL NOT NULL
);
"""


class JudgmentNotFound(NotFound):
    code = "judgment_not_found"
    default_hint = "judgment IDs look like 'jdg-0123456789abcdef'; list them with GET /v1/judgments"


class JudgmentStore(LockedSQLite):
    def __init__(self, path: Path):
        self.path = Path(path)
        super().__init__(open_private_sqlite(self.path, _SCHEMA))

    def add(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Insert one judgment (committed, fsynced by SQLite, before this returns)."""
        row = {**{k: fields.get(k) for k in FIELDS}, "id": f"jdg-{secrets.token_hex(8)}", "created_at": time.time()}
        with self._tx() as c:
            c.execute(f"INSERT INTO judgments ({', '.join(FIELDS)}) VALUES ({', '.join('?' for _ in FIELDS)})",
                      tuple(row[k] for k in FIELDS))
        return {"id": row["id"], "object": "judgment", **{k: row[k] for k in FIELDS if k != "id"}}

    def get(self, judgment_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._conn.execute("SELECT * FROM judgments WHERE id=?", (judgment_id,)).fetchone()
        if row is None:
            raise JudgmentNotFound(f"no judgment {judgment_id!r}")
        return _public(row)

    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM judgments").fetchone()[0])

    def page(self, *, after: str | None, limit: int, newest_first: bool = False) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` judgments that follow ``after`` in the order asked (oldest first, or newest first)
        and whether more follow."""
        seq = None
        with self._lock:
            if after is not None:
                row = self._conn.execute("SELECT seq FROM judgments WHERE id=?", (after,)).fetchone()
                if row is None:
                    raise JudgmentNotFound(f"no judgment {after!r} to page after")
                seq = row["seq"]
            if newest_first:
                sql = "SELECT * FROM judgments WHERE seq < ? ORDER BY seq DESC LIMIT ?"
                bound = seq if seq is not None else 2**62
            else:
                sql = "SELECT * FROM judgments WHERE seq > ? ORDER BY seq LIMIT ?"
                bound = seq if seq is not None else 0
            rows = self._conn.execute(sql, (bound, limit + 1)).fetchall()
        return [_public(r) for r in rows[:limit]], len(rows) > limit

    def latest_preferences(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` most recent non-tie judgments, oldest first (what a judge trains on)."""
        with self._lock:
            rows = self._conn.execute("SELECT * FROM judgments WHERE preferred != 'tie' ORDER BY seq DESC LIMIT ?",
                                      (limit,)).fetchall()
        return [_public(r) for r in reversed(rows)]

    def iter_all(self, batch: int = 500) -> Iterator[dict[str, Any]]:
        """Every judgment, oldest first, read in batches (the export)."""
        after = None
        while True:
            rows, more = self.page(after=after, limit=batch)
            yield from rows
            if not more or not rows:
                return
            after = rows[-1]["id"]


def _public(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "object": "judgment", **{k: row[k] for k in FIELDS if k != "id"}}
