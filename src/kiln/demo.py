"""`kiln demo`: the correction loop end to end on the built-in model."""

from __future__ import annotations

import typer


def demo() -> None:
    """Start Kiln on the built-in model, ask, correct, ask again (being implemented)."""
    raise typer.Exit(1)
