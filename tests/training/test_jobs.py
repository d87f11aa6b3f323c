"""The SQLite job queue with a real database file."""

from __future__ import annotations

import sqlite3

import pytest

from kiln.training.queue.jobs import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    JobNotFoundError,
    JobStateError,
    JobStore,
    QueueFullError,
)


def test_fifo_and_persistence(tmp_path):
    db = tmp_path / "jobs.sqlite3"
    store = JobStore(db, queue_max=4)
    a = store.submit("sft", "one", {"x": 1})
    b = store.submit("grpo", "two", {"x": 2})
    assert [store.queue_position(store.get(j.id)) for j in (a, b)] == [1, 2]
    claimed = store.claim_next()
    assert claimed.id == a.id and claimed.state == RUNNING and claimed.started_at is not None
    store.update_progress(a.id, {"step": 3, "total_steps": 10, "loss": 0.5, "tokens_per_s": 100.0, "eta_s": 1.2})
    store.finish(a.id, SUCCEEDED, result={"revision": "r"})
    store.close()

    again = JobStore(db, queue_max=4)
    assert again.recovered == []
    done = again.get(a.id)
    assert done.state == SUCCEEDED and done.result == {"revision": "r"} and done.progress["step"] == 3
    assert done.public()["loss"] == 0.5 and done.public()["eta_s"] == 1.2
    assert again.get(b.id).request == {"x": 2}
    assert again.claim_next().id == b.id
    assert again.claim_next() is None
    assert [j.id for j in again.list()] == [a.id, b.id]
    assert [j.id for j in again.list(limit=1, newest=True)] == [b.id]
    assert [j.id for j in again.list(states=frozenset({SUCCEEDED}))] == [a.id]
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_restart_fails_the_interrupted_job_and_keeps_the_queue(tmp_path):
    db = tmp_path / "jobs.sqlite3"
    store = JobStore(db, queue_max=4)
    a = store.submit("sft", "one", {})
    b = store.submit("sft", "two", {})
    store.claim_next()
    store.update_progress(a.id, {"step": 4, "total_steps": 9, "checkpoint_step": 4})
    # The process dies here: no finish(), no close().
    del store

    fresh = JobStore(db, queue_max=4)
    assert fresh.recovered == [a.id]
    failed = fresh.get(a.id)
    assert failed.state == FAILED
    assert "interrupted" in failed.error and "step 4 of 9" in failed.error and "resume_from_job" in failed.error
    assert fresh.get(b.id).state == QUEUED
    assert fresh.claim_next().id == b.id


def test_full_queue_refuses(tmp_path):
    store = JobStore(tmp_path / "j.sqlite3", queue_max=2)
    store.submit("sft", "a", {})
    store.submit("sft", "b", {})
    with pytest.raises(QueueFullError, match="2 of 2"):
        store.submit("sft", "c", {})
    store.claim_next()  # a running job frees a queue slot
    store.submit("sft", "c", {})


def test_cancel_queued_running_and_finished(tmp_path):
    store = JobStore(tmp_path / "j.sqlite3", queue_max=5)
    a = store.submit("sft", "a", {})
    b = store.submit("sft", "b", {})
    store.claim_next()
    running = store.cancel(a.id)
    assert running.state == RUNNING and running.cancel_requested and store.cancel_requested(a.id)
    queued = store.cancel(b.id)
    assert queued.state == CANCELLED
    assert store.claim_next() is None  # the cancelled job never starts
    store.finish(a.id, CANCELLED, error="cancelled at step 2")
    with pytest.raises(JobStateError, match="already cancelled"):
        store.cancel(a.id)
    with pytest.raises(JobNotFoundError):
        store.cancel("job-0000000000000000")
    with pytest.raises(ValueError):
        store.finish(b.id, RUNNING)


def test_database_and_directory_are_private(tmp_path):
    db = tmp_path / "training" / "jobs.sqlite3"
    store = JobStore(db, queue_max=4)
    store.submit("sft", "one", {"examples": ["private text"]})
    files = [p for p in db.parent.iterdir() if p.name.startswith("jobs.sqlite3")]
    assert db in files and len(files) >= 2  # the database and its WAL
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: 0o600 for p in files}
    assert db.parent.stat().st_mode & 0o777 == 0o700
    store.close()
    db.chmod(0o644)
    JobStore(db, queue_max=4).close()  # reopening tightens what was loosened
    assert db.stat().st_mode & 0o777 == 0o600


def test_restart_reconciles_a_job_published_before_the_crash(tmp_path):
    published = {}
    for name in ("published", "lost"):
        store = JobStore(tmp_path / f"{name}.sqlite3", queue_max=4)
        job = store.submit("sft", "a", {})
        store.claim_next()
        store.close()  # killed while the job runs
        published[name] = job.id
    found = {published["published"]: {"adapter": "a", "revision": "r1"}}
    store = JobStore(tmp_path / "published.sqlite3", queue_max=4, reconcile=lambda job: found.get(job.id))
    assert store.reconciled == [published["published"]] and store.recovered == []
    job = store.get(published["published"])
    assert job.state == SUCCEEDED and job.result == {"adapter": "a", "revision": "r1"} and job.error is None
    store = JobStore(tmp_path / "lost.sqlite3", queue_max=4, reconcile=lambda job: found.get(job.id))
    assert store.reconciled == [] and store.recovered == [published["lost"]]
    assert store.get(published["lost"]).state == FAILED


def test_a_job_can_be_resumed_only_once(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3", queue_max=4)
    first = store.submit("sft", "a", {})
    store.claim_next()
    store.finish(first.id, FAILED, error="boom")
    store.submit("sft", "a", {"resume_from_job": first.id})
    with pytest.raises(JobStateError) as info:
        store.submit("sft", "a", {"resume_from_job": first.id})
    assert info.value.status == 409 and info.value.code == "job_already_resumed"
