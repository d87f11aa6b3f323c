"""Cancelling a running training job once it has written a checkpoint (for resume tests)."""

from __future__ import annotations

import time

import pytest

from kiln.demo import wait_job


def cancel_after_checkpoint(client, job_id: str, step: int, *, timeout: float, poll_s: float = 0.01) -> dict:
    """Wait until job ``job_id`` has checkpointed at least ``step`` (or left the queue), cancel it,
    and return its final record; skips the test when the job finished before the cancel landed."""
    while True:
        j = client.get(f"/v1/train/jobs/{job_id}").json()
        if (j["progress"] or {}).get("checkpoint_step", 0) >= step or j["state"] not in ("queued", "running"):
            break
        time.sleep(poll_s)
    client.delete(f"/v1/train/queue/{job_id}")
    first = wait_job(client, job_id, timeout=timeout)
    if first["state"] == "succeeded":
        pytest.skip("the job finished before it could be cancelled")
    assert first["state"] == "cancelled"
    return first
