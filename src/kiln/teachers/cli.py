"""`kiln teacher` commands."""

from __future__ import annotations

from pathlib import Path

import click
import typer
from typer.core import TyperCommand

app = typer.Typer(help="Identity-bound vLLM teachers.", no_args_is_help=True)

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


class _VerbatimArgs(TyperCommand):
    """Hands every token after ``launch`` to the launcher exactly as typed.

    Click's own parsing would consume the ``--`` that separates the launcher's
    flags from the extra vLLM options, so ``-- --seed=3`` reached the launcher as
    one of its own (unknown) flags. The launcher parses its argv itself.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        ctx.args = list(args)
        return ctx.args


@app.command("launch", cls=_VerbatimArgs, context_settings=_PASS_THROUGH, add_help_option=False)
def launch(ctx: typer.Context) -> None:
    """Stage, fingerprint and supervise vLLM (same flags as scripts/vllm_teacher.py; --help lists them).

    Run it with the vLLM environment's python for a real launch; Kiln's own venv
    works for --manifest-only with --identity-input.
    """
    from kiln.teachers.launcher import main

    raise typer.Exit(main(list(ctx.args), prog="kiln teacher launch"))


@app.command("recover-stale")
def recover_stale(
    parent: list[Path] = typer.Argument(..., help="dedicated snapshot or runtime-cache parent(s)"),
) -> None:
    """Remove .building-*, ready-* and cache-* children whose launcher process is gone.

    Only run this against the launcher's dedicated parents; children of a live
    launcher are kept.
    """
    from kiln.system.private_dirs import recover_stale as recover

    for p in parent:
        report = recover(p)
        for name in report.removed:
            typer.echo(f"removed {p / name}")
        for name in report.kept_owned:
            typer.echo(f"kept {p / name} (its launcher is still running)")
