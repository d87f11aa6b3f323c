"""Durable eval state under ``eval.eval_dir``: suite files and the runs database.

* ``suites/<name>.json``: one canonical-JSON :class:`~kiln.evals.schemas.SuiteSpec` per file,
  written with the one atomic-publication helper (0600);
* ``runs.sqlite3`` (WAL, ``synchronous=FULL``, 0600, directory 0700): every run, comparison,
  replay and gate with its request, state, provenance, per-example results and aggregate.

Standard library + pydantic only.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.canonical import (
    FileTooLargeError,
    NotRegularFileError,
    atomic_write_json,
    canonical_json,
    canonical_sha256,
    read_regular_file,
)
from kiln.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from kiln.evals.schemas import SUITE_NAME_RE, SuiteSpec
from kiln.system.private_sqlite import LockedSQLite, open_private_sqlite

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
KINDS = ("run", "comparison", "replay", "gate")
MAX_LIST_RUNS = 100
MAX_SUITE_FILE_BYTES = 32 * 1024 * 1024
MAX_SUITES = 10_000
RESTART_REASON = "interrupted: the server stopped while this evaluation was running"
SUITE_DOMAIN = "kiln.eval-suite.v1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    progress TEXT NOT NULL DEFAULT '{}',
    result TEXT,
    error TEXT
);
CREATE INDEX IF NOT EXISTS runs_state ON runs(state, seq);
"""


class SuiteNotFound(NotFound):
    code = "suite_not_found"
    default_hint = "list suites with GET /v1/evals/suites"


class RunNotFound(NotFound):
    code = "eval_run_not_found"
    default_hint = "run IDs look like 'eval-0123456789abcdef'"


def suite_digest(suite: SuiteSpec) -> str:
    """sha256 of the suite's canonical JSON (examples, scorers, generation, aggregation)."""
    return canonical_sha256({"domain": SUITE_DOMAIN, "suite": suite.model_dump(mode="json")})


class SuiteStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _path(self, name: str) -> Path:
        if not SUITE_NAME_RE.fullmatch(name):
            raise SuiteNotFound(f"no suite {name!r}")
        return self.root / f"{name}.json"

    def put(self, suite: SuiteSpec, *, replace: bool = False) -> dict[str, Any]:
        path = self._path(suite.name)
        with self._lock:
            if path.exists() and not replace:
                raise Conflict(f"suite {suite.name!r} exists", code="suite_exists",
                               hint="DELETE it first, or pass ?replace=true")
            if not path.exists() and len(list(self.root.glob("*.json"))) >= MAX_SUITES:
                raise InvalidRequest(f"the store already holds {MAX_SUITES} suites", code="too_many_suites")
            atomic_write_json(path, suite.model_dump(mode="json"), mode=0o600)
        return self.summary(suite)

    def get(self, name: str) -> SuiteSpec:
        path = self._path(name)
        try:
            data = read_regular_file(path, MAX_SUITE_FILE_BYTES)
        except FileNotFoundError:
            raise SuiteNotFound(f"no suite {name!r}") from None
        except NotRegularFileError:  # a FIFO, directory or symlink in the suite store: no usable suite
            raise SuiteNotFound(f"suite file {name!r} is not a regular file; it is ignored") from None
        except FileTooLargeError:
            raise PayloadTooLarge(f"suite file {name!r} is larger than {MAX_SUITE_FILE_BYTES} bytes") from None
        return SuiteSpec.model_validate_json(data)

    def delete(self, name: str) -> dict[str, Any]:
        suite = self.get(name)
        self._path(name).unlink(missing_ok=True)
        return self.summary(suite)

    def list(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.root.glob("*.json")):
            try:
                out.append(self.summary(self.get(path.stem)))
            except (NotFound, ValueError):
                continue
        return out

    @staticmethod
    def summary(suite: SuiteSpec) -> dict[str, Any]:
        return {"name": suite.name, "description": suite.description, "examples": len(suite.examples),
                "scorers": [sc.type for sc in suite.scorers], "aggregation": suite.aggregation,
                "generation": suite.generation.model_dump(mode="json"), "suite_sha256": suite_digest(suite)}


@dataclass(frozen=True)
class Run:
    seq: int
    id: str
    kind: str
    state: str
    request: dict[str, Any]
    created_at: float
    started_at: float | None
    finished_at: float | None
    progress: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None

    def public(self, *, full: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "eval.run", "kind": self.kind, "state": self.state,
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "progress": self.progress, "error": self.error,
            "request": {k: v for k, v in self.request.items() if k != "inline_suite"},
        }
        result = self.result or {}
        if full:
            body["result"] = self.result
        else:
            body["result"] = {k: result[k] for k in ("aggregate", "verdict", "replay", "gate") if k in result}
        return body


class RunStore(LockedSQLite):
    """The runs table: a FIFO of queued runs plus every finished one."""

    def __init__(self, path: Path):
        self.path = Path(path)
        super().__init__(open_private_sqlite(self.path, _SCHEMA))
        self.recovered = self._settle_interrupted()

    def _settle_interrupted(self) -> list[str]:
        """Runs left queued or running by a previous process fail (their worker is gone)."""
        with self._tx() as c:
            ids = [r["id"] for r in c.execute("SELECT id FROM runs WHERE state IN (?, ?)", (QUEUED, RUNNING))]
            c.execute("UPDATE runs SET state=?, error=?, finished_at=? WHERE state IN (?, ?)",
                      (FAILED, RESTART_REASON, time.time(), QUEUED, RUNNING))
        return ids

    def create(self, kind: str, request: dict[str, Any], *, state: str = QUEUED,
               result: dict[str, Any] | None = None) -> Run:
        run_id = f"eval-{secrets.token_hex(8)}"
        now = time.time()
        finished = now if state in TERMINAL else None
        with self._tx() as c:
            c.execute("INSERT INTO runs (id, kind, state, request, created_at, finished_at, result) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (run_id, kind, state, canonical_json(request), now, finished,
                       None if result is None else canonical_json(result)))
        return self.get(run_id)

    def claim(self, run_id: str) -> bool:
        with self._tx() as c:
            cur = c.execute("UPDATE runs SET state=?, started_at=? WHERE id=? AND state=?",
                            (RUNNING, time.time(), run_id, QUEUED))
            return cur.rowcount == 1

    def progress(self, run_id: str, progress: dict[str, Any]) -> None:
        with self._tx() as c:
            c.execute("UPDATE runs SET progress=? WHERE id=?", (json.dumps(progress), run_id))

    def finish(self, run_id: str, state: str, *, result: dict[str, Any] | None = None,
               error: str | None = None) -> None:
        with self._tx() as c:
            c.execute("UPDATE runs SET state=?, result=?, error=?, finished_at=? WHERE id=? AND state IN (?, ?)",
                      (state, None if result is None else canonical_json(result), error, time.time(), run_id,
                       QUEUED, RUNNING))

    def cancel_queued(self, run_id: str) -> Run:
        run = self.get(run_id)
        if run.state in TERMINAL:
            raise Conflict(f"run {run_id} is already {run.state}", code="eval_run_finished")
        with self._tx() as c:
            c.execute("UPDATE runs SET state=?, error=?, finished_at=? WHERE id=? AND state=?",
                      (CANCELLED, "cancelled before it started", time.time(), run_id, QUEUED))
        return self.get(run_id)

    def get(self, run_id: str) -> Run:
        with self._lock:
            row = self._conn.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(f"no eval run {run_id!r}")
        return _run(row)

    def counts(self) -> dict[str, int]:
        """Runs by state, every state present (``kiln_eval_runs{state}``)."""
        with self._lock:
            rows = self._conn.execute("SELECT state, COUNT(*) AS n FROM runs GROUP BY state").fetchall()
        return {s: 0 for s in (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)} | {r["state"]: r["n"] for r in rows}

    def list(self, *, limit: int = MAX_LIST_RUNS) -> list[Run]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM runs ORDER BY seq DESC LIMIT ?",
                                      (min(limit, MAX_LIST_RUNS),)).fetchall()
        return [_run(r) for r in rows]


def _run(row: sqlite3.Row) -> Run:
    return Run(row["seq"], row["id"], row["kind"], row["state"], json.loads(row["request"]), row["created_at"],
               row["started_at"], row["finished_at"], json.loads(row["progress"] or "{}"),
               None if row["result"] is None else json.loads(row["result"]), row["error"])
