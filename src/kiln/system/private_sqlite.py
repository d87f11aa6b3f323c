"""An owner-only SQLite database in WAL mode (eval runs, judgments): directory 0700, the database and its
``-wal``/``-shm`` files 0600, autocommit connection shared across threads; and :class:`LockedSQLite`, the
one lock + transaction discipline every store over such a connection uses (eval runs, judgments, the training
job queue)."""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SQLITE_BUSY_TIMEOUT_S = 10.0


def _private(path: Path) -> None:
    if path.exists():
        os.chmod(path, 0o600)


def open_private_sqlite(path: Path, schema: str) -> sqlite3.Connection:
    """Create (0600, in a 0700 directory) or open ``path``, switch it to WAL with full sync, apply ``schema``."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    _private(path)
    conn = sqlite3.connect(str(path), timeout=SQLITE_BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript(schema)
    for extra in ("-wal", "-shm"):
        _private(Path(str(path) + extra))
    return conn


class LockedSQLite:
    """A store over one autocommit connection shared across threads: ``_lock`` guards every use of ``_conn``,
    :meth:`_tx` runs a ``BEGIN IMMEDIATE`` transaction under it (rolled back on any exception)."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
