"""`kiln model` commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)


@app.command("init")
def init(
    directory: Optional[Path] = typer.Argument(None, help="Where to build (default: $KILN_HOME/models/kiln-builtin-v1)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if the directory exists."),
) -> None:
    """Build Kiln's built-in model offline (tokenizer, chat template, tiny Qwen3, safetensors)."""
    import shutil
    import time

    from kiln.config import kiln_home
    from kiln.runtime.builtin import build_builtin_model, builtin_model_dir
    from kiln.runtime.loader import inspect_model_dir

    target = directory or builtin_model_dir(kiln_home())
    if target.exists():
        if not force:
            info = inspect_model_dir(target)
            typer.echo(json.dumps({"path": str(info.path), "base_model_sha256": info.base_model_sha256, "built": False}))
            return
        shutil.rmtree(target)
    t0 = time.perf_counter()
    with _spinner(f"building the built-in model in {target}"):
        build_builtin_model(target)
    info = inspect_model_dir(target)
    typer.echo(
        json.dumps(
            {"path": str(info.path), "base_model_sha256": info.base_model_sha256, "built": True,
             "seconds": round(time.perf_counter() - t0, 2)}
        )
    )


@app.command("inspect")
def inspect(directory: Path = typer.Argument(..., help="A local Hugging Face model directory.")) -> None:
    """Verify a model directory and print its identity (no weights are loaded)."""
    from kiln.runtime.loader import ModelLoadError, inspect_model_dir

    try:
        info = inspect_model_dir(directory)
    except ModelLoadError as exc:
        typer.echo(json.dumps({"error": {"code": "model_refused", "message": str(exc)}}))
        raise typer.Exit(2)
    typer.echo(
        json.dumps(
            {
                "path": str(info.path),
                "model_type": info.model_type,
                "base_model_sha256": info.base_model_sha256,
                "safetensors": [{"name": n, "bytes": b, "sha256": d} for n, b, d in info.safetensors],
            }
        )
    )


def _spinner(text: str):
    from rich.console import Console

    return Console(stderr=True).status(text)
