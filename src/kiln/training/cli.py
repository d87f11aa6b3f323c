"""`kiln train` commands (client side: they talk to a running server)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Submit and follow LoRA training jobs on a running server.", no_args_is_help=True)
