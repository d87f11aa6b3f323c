"""`kiln teachers` commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="Identity-bound vLLM teachers.", no_args_is_help=True)
