"""The training job queue: FIFO, persisted in SQLite (WAL) under the Kiln home.

States: ``queued -> running -> succeeded | failed | cancelled`` and
``queued -> cancelled``. The table is the source of truth; the worker claims
the oldest queued job in one transaction. Opening a store after a crash or
restart settles every job left ``running``: ``succeeded`` when its output was
published before the crash (the caller's ``reconcile`` finds it), else
``failed`` with the reason, so queued jobs behind it still run. The database
holds inline training examples: its directory is 0700 and its files 0600.
Standard library only.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.canonical import canonical_json
from kiln.errors import Conflict, NotFound, Unavailable
from kiln.system.private_sqlite import LockedSQLite

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
SQLITE_BUSY_TIMEOUT_S = 10.0
MAX_LIST_JOBS = 100
RESTART_REASON = "interrupted: the server stopped while this job was running"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    adapter TEXT NOT NULL,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    progress TEXT NOT NULL DEFAULT '{}',
    result TEXT,
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
"""


class QueueFullError(Unavailable):
    """The queue holds ``queue_max`` queued jobs; retry after one has started."""

    code = "training_queue_full"
    default_hint = "retry after a queued job has started, or cancel one"


class JobNotFoundError(NotFound):
    code = "job_not_found"
    default_hint = "list jobs with GET /v1/train/status"


class JobStateError(Conflict):
    """The job is in a state that does not allow the operation (e.g. cancel a finished job)."""

    code = "job_finished"


@dataclass(frozen=True)
class Job:
    seq: int
    id: str
    kind: str
    adapter: str
    state: str
    request: dict[str, Any]
    created_at: float
    started_at: float | None
    finished_at: float | None
    cancel_requested: bool
    progress: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None

    def public(self, *, queue_position: int | None = None) -> dict[str, Any]:
        """The job as reported over HTTP (request body omitted: it can be large)."""
        out = {
            "id": self.id,
            "kind": self.kind,
            "adapter": self.adapter,
            "state": self.state,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "cancel_requested": self.cancel_requested,
            "error": self.error,
            "result": self.result,
            **{k: self.progress.get(k) for k in ("step", "total_steps", "loss", "tokens_per_s", "eta_s")},
            "progress": self.progress,
        }
        if queue_position is not None:
            out["queue_position"] = queue_position
        return out


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _private_file(path: Path, *, create: bool) -> None:
    """Make ``path`` owner-only (0600), creating it empty first when ``create``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def new_job_id() -> str:
    return "job-" + secrets.token_hex(8)


class JobStore(LockedSQLite):
    """Thread-safe access to ``jobs.sqlite3``; one connection guarded by a lock."""

    def __init__(self, path: Path, *, queue_max: int,
                 reconcile: Callable[[Job], dict[str, Any] | None] | None = None):
        """Open (or create, private: directory 0700, files 0600) the queue.

        Jobs left ``running`` by a previous process are settled: ``reconcile(job)``
        returns the result of a job whose output was published before the
        process died (it becomes ``succeeded``); every other one is ``failed``.
        """
        self.path = Path(path)
        self.queue_max = queue_max
        _private_dir(self.path.parent)
        for suffix in ("", "-wal", "-shm", "-journal"):
            _private_file(Path(str(self.path) + suffix), create=not suffix)
        super().__init__(sqlite3.connect(
            str(self.path), timeout=SQLITE_BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None
        ))
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(_SCHEMA)
        self.reconciled: list[str] = []
        self.recovered = self._settle_interrupted(reconcile)

    def _settle_interrupted(self, reconcile: Callable[[Job], dict[str, Any] | None] | None) -> list[str]:
        now = time.time()
        with self._lock:
            interrupted = [_job(r) for r in self._conn.execute("SELECT * FROM jobs WHERE state = ?", (RUNNING,))]
        failed = []
        for job in interrupted:
            result = reconcile(job) if reconcile is not None else None
            with self._tx() as db:
                if result is not None:
                    db.execute("UPDATE jobs SET state = ?, result = ?, finished_at = ? WHERE id = ? AND state = ?",
                               (SUCCEEDED, canonical_json(result), now, job.id, RUNNING))
                    self.reconciled.append(job.id)
                    continue
                progress = job.progress
                reason = RESTART_REASON + f" (at step {progress.get('step', 0)} of {progress.get('total_steps', '?')})"
                if progress.get("checkpoint_step"):
                    reason += (
                        f"; its checkpoint at step {progress['checkpoint_step']} can be continued by "
                        f"submitting the same request with resume_from_job={job.id!r}"
                    )
                db.execute("UPDATE jobs SET state = ?, error = ?, finished_at = ? WHERE id = ? AND state = ?",
                           (FAILED, reason, now, job.id, RUNNING))
                failed.append(job.id)
        return failed

    # ----------------------------------------------------------------- writes
    def submit(self, kind: str, adapter: str, request: dict[str, Any]) -> Job:
        """Queue a job. A ``resume_from_job`` that another live or succeeded job already resumes is a 409."""
        job_id = new_job_id()
        resumes = request.get("resume_from_job")
        with self._tx() as db:
            if resumes:
                other = db.execute(
                    "SELECT id, state FROM jobs WHERE json_extract(request, '$.resume_from_job') = ? "
                    "AND state IN (?, ?, ?) LIMIT 1", (resumes, QUEUED, RUNNING, SUCCEEDED)).fetchone()
                if other is not None:
                    raise JobStateError(
                        f"job {resumes} is already being resumed by {other['id']} ({other['state']})",
                        code="job_already_resumed", hint=f"follow {other['id']}, or resume it instead once it fails")
            (queued,) = db.execute("SELECT COUNT(*) FROM jobs WHERE state = ?", (QUEUED,)).fetchone()
            if queued >= self.queue_max:
                raise QueueFullError(f"the training queue is full ({queued} of {self.queue_max} jobs queued)")
            db.execute(
                "INSERT INTO jobs (id, kind, adapter, state, request, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, kind, adapter, QUEUED, canonical_json(request), time.time()),
            )
        return self.get(job_id)

    def claim_next(self) -> Job | None:
        """Move the oldest queued job to ``running`` and return it (None if none)."""
        with self._tx() as db:
            row = db.execute("SELECT id FROM jobs WHERE state = ? ORDER BY seq LIMIT 1", (QUEUED,)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET state = ?, started_at = ? WHERE id = ?", (RUNNING, time.time(), row["id"]))
        return self.get(row["id"])

    def update_progress(self, job_id: str, progress: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET progress = ? WHERE id = ?", (canonical_json(progress), job_id))

    def finish(self, job_id: str, state: str, *, result: dict[str, Any] | None = None, error: str | None = None) -> None:
        if state not in TERMINAL:
            raise ValueError(f"{state!r} is not a terminal state")
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET state = ?, result = ?, error = ?, finished_at = ? WHERE id = ? AND state = ?",
                (state, None if result is None else canonical_json(result), error, time.time(), job_id, RUNNING),
            )

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued job now, or flag a running job to stop at its next step boundary."""
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise JobNotFoundError(f"no job {job_id}")
            if row["state"] == QUEUED:
                db.execute(
                    "UPDATE jobs SET state = ?, cancel_requested = 1, finished_at = ?, error = ? WHERE id = ?",
                    (CANCELLED, time.time(), "cancelled before it started", job_id),
                )
            elif row["state"] == RUNNING:
                db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            else:
                raise JobStateError(f"job {job_id} is already {row['state']}; only queued or running jobs can be cancelled")
        return self.get(job_id)

    # ------------------------------------------------------------------ reads
    def get(self, job_id: str) -> Job:
        with self._lock:
            row = self._conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFoundError(f"no job {job_id}")
        return _job(row)

    def cancel_requested(self, job_id: str) -> bool:
        with self._lock:
            row = self._conn.execute("SELECT cancel_requested FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return bool(row and row["cancel_requested"])

    def counts(self) -> dict[str, int]:
        """Jobs by state, every state present (``kiln_training_jobs{state}``)."""
        with self._lock:
            rows = self._conn.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state").fetchall()
        return {state: 0 for state in (QUEUED, RUNNING, *sorted(TERMINAL))} | {r["state"]: r["n"] for r in rows}

    def active(self) -> list[Job]:
        """The queued and running jobs."""
        return self.list(states=frozenset({QUEUED, RUNNING}))

    def list(self, *, states: frozenset[str] | None = None, limit: int = MAX_LIST_JOBS,
             newest: bool = False) -> list[Job]:
        """Up to ``limit`` jobs in FIFO order (oldest first), optionally filtered by state.

        ``newest`` picks the most recent matching jobs instead of the oldest ones.
        """
        limit = max(1, min(limit, MAX_LIST_JOBS))
        states = states or frozenset({QUEUED, RUNNING, *TERMINAL})
        marks = ",".join("?" * len(states))
        order = "DESC" if newest else "ASC"
        with self._lock:
            rows = self._conn.execute(
                f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY seq {order} LIMIT ?", (*sorted(states), limit)
            ).fetchall()
        jobs = [_job(r) for r in rows]
        return jobs[::-1] if newest else jobs

    def queue_position(self, job: Job) -> int | None:
        """1-based position among queued jobs, or None when not queued."""
        if job.state != QUEUED:
            return None
        with self._lock:
            (ahead,) = self._conn.execute(
                "SELECT COUNT(*) FROM jobs WHERE state = ? AND seq < ?", (QUEUED, job.seq)
            ).fetchone()
        return ahead + 1


def _job(row: sqlite3.Row) -> Job:
    return Job(
        seq=row["seq"],
        id=row["id"],
        kind=row["kind"],
        adapter=row["adapter"],
        state=row["state"],
        request=json.loads(row["request"]),
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        cancel_requested=bool(row["cancel_requested"]),
        progress=json.loads(row["progress"]),
        result=None if row["result"] is None else json.loads(row["result"]),
        error=row["error"],
    )
