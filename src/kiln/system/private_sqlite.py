"""An owner-only SQLite database in WAL mode (eval runs, judgments): directory 0700, the database and its
``-wal``/``-shm`` files 0600, autocommit connection shared across threads (callers hold their own lock)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

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
