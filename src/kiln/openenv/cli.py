"""``kiln openenv train|start|status|cancel|artifact``: OpenEnv runs on a running ``kiln serve`` (HTTP only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.client import HTTP_TIMEOUT_S, UrlOpt, auth_headers, fail, follow, request

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


def _request_body(env_url: str, adapter: str, instructions: str, group_size: int, groups: int, max_steps: int,
                  seed: int, temperature: float, training: Path | None,
                  policy_adapter: str | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if training is not None:
        try:
            extra = json.loads(training.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            fail(f"cannot read {training}: {exc}")
        if not isinstance(extra, dict):
            fail(f"{training} must hold a JSON object")
    return {"env_url": env_url, "instructions": instructions, "group_size": group_size, "groups": groups,
            "max_steps": max_steps, "seed": seed, "temperature": temperature, "policy_adapter": policy_adapter,
            "training": {**extra, "adapter": adapter}}


EnvUrlArg = typer.Argument(..., help="the OpenEnv server on loopback, e.g. http://127.0.0.1:8001")
AdapterOpt = typer.Option(..., "--adapter", help="name the trained adapter is published under")
InstructionsOpt = typer.Option("", "--instructions", help="system prompt (the action schema is appended)")
GroupSizeOpt = typer.Option(4, "--group-size", help="episodes per group (one reset seed per group)")
GroupsOpt = typer.Option(4, "--groups")
MaxStepsOpt = typer.Option(8, "--max-steps", help="Kiln's step cutoff per episode")
SeedOpt = typer.Option(0, "--seed")
TemperatureOpt = typer.Option(1.0, "--temperature")
PolicyOpt = typer.Option(None, "--policy-adapter", help="a loaded adapter that plays the episodes (default: the base model)")
TrainingOpt = typer.Option(None, "--training", help="JSON file with more GRPO fields (learning_rate, epochs, "
                           "lora_rank, auto_load, ...)")


def _follow_to_end(base: str, run: dict[str, Any]) -> dict[str, Any]:
    run = follow(f"{base}/v1/openenv/runs/{run['id']}", run["id"], _progress)
    _summary(run)
    if run["state"] != "succeeded":
        err = run.get("error") or {}
        fail(f"run {run['id']} {run['state']}: {err.get('code')}: {err.get('message')}")
    return run


@app.command()
def start(
    env_url: str = EnvUrlArg, adapter: str = AdapterOpt, instructions: str = InstructionsOpt,
    group_size: int = GroupSizeOpt, groups: int = GroupsOpt, max_steps: int = MaxStepsOpt, seed: int = SeedOpt,
    temperature: float = TemperatureOpt, training: Optional[Path] = TrainingOpt,
    policy_adapter: Optional[str] = PolicyOpt,
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the run until it ends"),
    url: str = UrlOpt,
) -> None:
    """Start a run: preflight, episodes, identity re-check, GRPO job."""
    body = _request_body(env_url, adapter, instructions, group_size, groups, max_steps, seed, temperature, training,
                         policy_adapter)
    base = url.rstrip("/")
    run = request("POST", f"{base}/v1/openenv/runs", json=body)
    typer.echo(f"started {run['id']}")
    if wait:
        _follow_to_end(base, run)


@app.command()
def train(
    env_url: str = EnvUrlArg, adapter: str = AdapterOpt, instructions: str = InstructionsOpt,
    group_size: int = GroupSizeOpt, groups: int = GroupsOpt, max_steps: int = MaxStepsOpt, seed: int = SeedOpt,
    temperature: float = TemperatureOpt, training: Optional[Path] = TrainingOpt,
    policy_adapter: Optional[str] = PolicyOpt, url: str = UrlOpt,
) -> None:
    """Preflight (effective GRPO config + environment identity, nothing spent), then run and follow to the end."""
    body = _request_body(env_url, adapter, instructions, group_size, groups, max_steps, seed, temperature, training,
                         policy_adapter)
    base = url.rstrip("/")
    pre = request("POST", f"{base}/v1/openenv/preflight", json=body)
    env, contract, cap = pre["environment"], pre["training_contract"], pre["capacity"]
    typer.echo(f"environment {env.get('name') or env['url']}: discovery {env['discovery_sha256'][:16]}")
    typer.echo(f"GRPO config {pre['training_contract_sha256'][:16]}: epochs {contract['epochs']}, learning_rate "
               f"{contract['learning_rate']}, lora_rank {contract['lora_rank']}; runs active {cap['active_runs']}, "
               f"queued {cap['queued_runs']}")
    run = request("POST", f"{base}/v1/openenv/runs", json=body)
    typer.echo(f"started {run['id']}")
    run = _follow_to_end(base, run)
    if "train_receipt.json" in (run.get("artifacts") or {}):
        typer.echo(f"receipt: kiln openenv artifact {run['id']} train_receipt.json --out receipt.json")


@app.command()
def artifact(
    run_id: str = typer.Argument(..., help="the run"),
    name: str = typer.Argument(..., help="an artifact the run lists: rollouts.jsonl, replay.json, train_receipt.json"),
    out: Path = typer.Option(..., "--out", help="where to write it (published atomically after verification)"),
    url: str = UrlOpt,
) -> None:
    """Download a run artifact: length and SHA-256 checked against the run's manifest while staging, then renamed
    into place; nothing is left at --out when a check fails."""
    base = url.rstrip("/")
    run = request("GET", f"{base}/v1/openenv/runs/{run_id}")
    entry = (run.get("artifacts") or {}).get(name)
    if entry is None:
        fail(f"run {run_id} has no artifact {name!r} (it has: {sorted(run.get('artifacts') or {})})")
    try:
        download_verified(f"{base}/v1/openenv/runs/{run_id}/artifacts/{name}", out, entry["bytes"], entry["sha256"])
    except (ArtifactCheckFailed, OSError) as exc:
        fail(str(exc))
    typer.echo(f"{out}: {entry['bytes']} bytes, sha256 {entry['sha256']}")


class ArtifactCheckFailed(Exception):
    pass


def download_verified(url: str, out: Path, size: int, sha256: str) -> None:
    """Stream ``url`` into a staging file beside ``out`` (no redirects, headers, length and SHA-256 checked
    against ``size``/``sha256``), fsync, rename over ``out``, fsync the directory."""
    import os
    import tempfile

    import httpx

    from kiln.canonical import fsync_dir

    out = out.resolve()
    fd, staging = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                seen, digest = _stream_checked(url, f, size, sha256)
            except httpx.HTTPError as exc:
                raise ArtifactCheckFailed(f"download failed: {exc}") from None
            f.flush()
            os.fsync(f.fileno())
        if seen != size or digest != sha256:
            raise ArtifactCheckFailed(f"received {seen} bytes with sha256 {digest}; the manifest says "
                                      f"{size} bytes, {sha256}")
        os.replace(staging, out)
        fsync_dir(out.parent)
    except BaseException:
        try:
            os.unlink(staging)
        except FileNotFoundError:
            pass
        raise


def _stream_checked(url: str, f: Any, size: int, sha256: str) -> tuple[int, str]:
    """Write the body of ``GET url`` to ``f`` after checking status and headers; ``(bytes, sha256)`` seen."""
    import hashlib

    import httpx

    from kiln.openenv.schemas import ARTIFACT_SHA256_HEADER

    digest, seen = hashlib.sha256(), 0
    with httpx.Client(follow_redirects=False, trust_env=False, timeout=HTTP_TIMEOUT_S,
                      headers=auth_headers()) as client, \
            client.stream("GET", url) as r:
        if r.status_code != 200:
            r.read()
            try:
                err = r.json().get("error", {})
            except ValueError:
                err = {}
            raise ArtifactCheckFailed(f"{r.status_code} {err.get('code', '')}: {err.get('message', r.text[:300])}")
        if r.headers.get("content-length") != str(size) or r.headers.get(ARTIFACT_SHA256_HEADER) != sha256:
            raise ArtifactCheckFailed(f"the server's headers (length {r.headers.get('content-length')}, sha256 "
                                      f"{r.headers.get(ARTIFACT_SHA256_HEADER)}) do not match the run's manifest")
        for chunk in r.iter_raw():
            seen += len(chunk)
            if seen > size:
                raise ArtifactCheckFailed(f"the server sent more than the manifest's {size} bytes")
            digest.update(chunk)
            f.write(chunk)
    return seen, digest.hexdigest()


def _summary(run: dict[str, Any]) -> None:
    r = run.get("returns") or {}
    terms = ", ".join(f"{k} {v}" for k, v in run["terminations"].items() if v)
    if r:
        typer.echo(f"returns: mean {r['mean']:.3f} min {r['min']:.3f} max {r['max']:.3f}; terminations: {terms}")
    policy = run.get("policy")
    if policy:  # the one policy revision every action came from (docs/openenv.md, "Policy identity")
        who = f"{policy['adapter']}@{policy['revision'][:16]}" if policy.get("adapter") else "the base model"
        typer.echo(f"policy: {who}")
    job = run.get("training_job")
    if job:
        result = job.get("result") or {}
        published = f"; published {result['adapter']} revision {result['revision'][:16]}" if result.get("revision") else ""
        typer.echo(f"training job {job['id']}: {job['state']}{published}")


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
