"""``kiln openenv start|status|cancel``: OpenEnv runs on a running ``kiln serve`` (HTTP only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.client import UrlOpt, fail, follow, request

app = typer.Typer(help="Collect episodes on an OpenEnv environment and train a LoRA adapter on them (GRPO).",
                  no_args_is_help=True)


def _progress(run: dict[str, Any]) -> tuple[int | None, int, str]:
    req, p = run["request"], run["progress"]
    total = req["groups"] * req["group_size"]
    info = run["state"]
    if run.get("queue_position"):
        info = f"queued (position {run['queue_position']})"
    elif run.get("returns"):
        info = f"{run['state']}  mean return {run['returns']['mean']:.3f}"
    if run["state"] == "training" and run.get("training_job"):
        info += f"  job {run['training_job']['id']} {run['training_job']['state']}"
    return total, p["episodes_done"], info


@app.command()
def start(
    env_url: str = typer.Argument(..., help="the OpenEnv server on loopback, e.g. http://127.0.0.1:8001"),
    adapter: str = typer.Option(..., "--adapter", help="name the trained adapter is published under"),
    instructions: str = typer.Option("", "--instructions", help="system prompt (the action schema is appended)"),
    group_size: int = typer.Option(4, "--group-size"),
    groups: int = typer.Option(4, "--groups"),
    max_steps: int = typer.Option(8, "--max-steps"),
    seed: int = typer.Option(0, "--seed"),
    temperature: float = typer.Option(1.0, "--temperature"),
    training: Optional[Path] = typer.Option(None, "--training", help="JSON file with more GRPO fields "
                                            "(learning_rate, epochs, lora_rank, auto_load, ...)"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the run until it ends"),
    url: str = UrlOpt,
) -> None:
    """Start a run: preflight, episodes, identity re-check, GRPO job."""
    extra: dict[str, Any] = {}
    if training is not None:
        try:
            extra = json.loads(training.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            fail(f"cannot read {training}: {exc}")
        if not isinstance(extra, dict):
            fail(f"{training} must hold a JSON object")
    body = {"env_url": env_url, "instructions": instructions, "group_size": group_size, "groups": groups,
            "max_steps": max_steps, "seed": seed, "temperature": temperature,
            "training": {**extra, "adapter": adapter}}
    base = url.rstrip("/")
    run = request("POST", f"{base}/v1/openenv/runs", json=body)
    typer.echo(f"started {run['id']}")
    if not wait:
        return
    run = follow(f"{base}/v1/openenv/runs/{run['id']}", run["id"], _progress)
    _summary(run)
    if run["state"] != "succeeded":
        err = run.get("error") or {}
        fail(f"run {run['id']} {run['state']}: {err.get('code')}: {err.get('message')}")


def _summary(run: dict[str, Any]) -> None:
    r = run.get("returns") or {}
    terms = ", ".join(f"{k} {v}" for k, v in run["terminations"].items() if v)
    if r:
        typer.echo(f"returns: mean {r['mean']:.3f} min {r['min']:.3f} max {r['max']:.3f}; terminations: {terms}")
    job = run.get("training_job")
    if job:
        typer.echo(f"training job {job['id']}: {job['state']}")


@app.command()
def status(run_id: Optional[str] = typer.Argument(None, help="one run; default: every run"), url: str = UrlOpt) -> None:
    """Show one run (as JSON) or a table of every run."""
    base = url.rstrip("/")
    if run_id is not None:
        typer.echo(json.dumps(request("GET", f"{base}/v1/openenv/runs/{run_id}"), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="OpenEnv runs")
    for col in ("run", "state", "queue", "episodes", "mean return", "job", "error"):
        table.add_column(col)
    for run in request("GET", f"{base}/v1/openenv/runs")["data"]:
        r = run.get("returns") or {}
        job = run.get("training_job") or {}
        err = run.get("error") or {}
        table.add_row(run["id"], run["state"], str(run.get("queue_position") or ""),
                      str(run["progress"]["episodes_done"]), f"{r['mean']:.3f}" if r else "",
                      f"{job.get('id', '')} {job.get('state', '')}".strip(), err.get("code", ""))
    Console().print(table)


@app.command()
def cancel(run_id: str, url: str = UrlOpt) -> None:
    """Cancel a queued or running run."""
    run = request("POST", f"{url.rstrip('/')}/v1/openenv/runs/{run_id}/cancel")
    typer.echo(f"{run['id']}: {run['state']}")
