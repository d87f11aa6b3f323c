"""The ``kiln`` command.

Each command group lives in its own package's ``cli`` module, which imports
only typer/rich at import time; torch, transformers, peft and vLLM are imported
inside the commands that need them so ``kiln --help`` stays fast.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kiln",
    help="Serve a language model over an OpenAI-compatible API and train LoRA adapters while serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# (command group name, module holding a ``app: typer.Typer``)
_GROUPS: list[tuple[str, str]] = [
    ("model", "kiln.runtime.cli"),
    ("distill", "kiln.distill.cli"),
    ("teacher", "kiln.teachers.cli"),
    ("teachers", "kiln.teachers.registry_cli"),
    ("ranks", "kiln.cluster.cli"),
    ("train", "kiln.training.cli"),
    ("adapters", "kiln.adapters.cli"),
    ("eval", "kiln.evals.cli"),
    ("openenv", "kiln.openenv.cli"),
    ("judgments", "kiln.judgments.cli"),
]

# Top-level commands: (module, function name) registered as ``kiln <name>``.
_COMMANDS: list[tuple[str, str, str]] = [
    ("serve", "kiln.serving.cli", "serve"),
    ("demo", "kiln.demo", "demo"),
]

for _name, _module in _GROUPS:
    app.add_typer(importlib.import_module(_module).app, name=_name)
for _name, _module, _func in _COMMANDS:
    app.command(_name)(getattr(importlib.import_module(_module), _func))


@app.command()
def version() -> None:
    """Print Kiln's version."""
    from kiln import __version__

    typer.echo(__version__)


def main() -> None:  # console-script entry point
    app()


if __name__ == "__main__":
    main()
