"""`kiln serve`."""

from __future__ import annotations

import typer


def serve() -> None:
    """Start the OpenAI-compatible server (being implemented)."""
    raise typer.Exit(1)
