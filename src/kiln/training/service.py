"""Training service wiring: attaches the job queue and trainer to a running server."""

from __future__ import annotations

from typing import Any


def attach_training(state: Any) -> None:
    """Attach the training job queue/worker to ``state`` (being implemented)."""
    return None
