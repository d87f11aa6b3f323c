"""`kiln distill` commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="Offline distillation artifacts (autodistill v1).", no_args_is_help=True)
