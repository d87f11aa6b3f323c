"""Named crash points for the distillation workers' kill tests.

``KILN_DISTILL_FAULT=<point>`` makes the process ``os._exit(137)`` exactly at
that step: no ``finally`` blocks, no atexit handlers, like ``kill -9``. Unset,
``fault`` is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import os

__all__ = ["CAPTURE_FAULT_POINTS", "FAULT_ENV", "FAULT_EXIT_CODE", "KD_JOB_FAULT_POINTS", "TRAIN_FAULT_POINTS", "fault"]

FAULT_ENV = "KILN_DISTILL_FAULT"
FAULT_EXIT_CODE = 137

# Capture: each publication step of shards.py, plus a torn payload write.
CAPTURE_FAULT_POINTS = (
    "capture_after_begin",
    "capture_torn_payload",
    "capture_after_payload",
    "capture_after_complete",
    "capture_after_verified",
    "publish_after_rename",
    "capture_after_available",
)
# Training: each ledger step and the checkpoint between them.
TRAIN_FAULT_POINTS = (
    "train_after_reserve",
    "train_mid_shard",
    "train_after_checkpoint",
    "train_after_commit",
    "train_after_release",
)
# The server's KD job (kiln.training.kd.job.run_kd): the whole `kiln serve` process dies there.
KD_JOB_FAULT_POINTS = ("kd_job_after_reserve", "kd_job_after_checkpoint")


def fault(point: str) -> None:
    """Exit abruptly if ``KILN_DISTILL_FAULT`` names ``point``."""
    if os.environ.get(FAULT_ENV) == point:
        os._exit(FAULT_EXIT_CODE)
