"""How a training job stops early: cancelled at a step boundary, or failed."""

from __future__ import annotations


class JobCancelled(Exception):
    """Raised at a step boundary when the job was asked to stop."""

    def __init__(self, step: int):
        super().__init__(f"cancelled at step {step}")
        self.step = step


class TrainingFailed(RuntimeError):
    """The loop cannot continue (non-finite loss, bad checkpoint...)."""
