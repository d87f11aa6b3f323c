"""`kiln adapters` commands (client side: they talk to a running server)."""

from __future__ import annotations

import typer

app = typer.Typer(help="List, load, unload and delete adapters on a running server.", no_args_is_help=True)
