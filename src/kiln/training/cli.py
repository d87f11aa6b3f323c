"""`kiln train` commands (client side: they talk to a running server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.client import UrlOpt, fail, read_json_rows, request
from kiln.client import follow as follow_state

app = typer.Typer(help="Submit and follow LoRA training jobs on a running server.", no_args_is_help=True)


def follow(url: str, job_id: str) -> dict[str, Any]:
    """Show a progress bar for ``job_id`` until it finishes; return the final job."""

    def progress(job: dict[str, Any]) -> tuple[int | None, int, str]:
        info = job["state"]
        if job.get("loss") is not None:
            info = f"loss {job['loss']:.4f}  {job.get('tokens_per_s') or 0:.0f} tok/s  ETA {job.get('eta_s') or 0:.1f}s"
        elif job.get("queue_position"):
            info = f"queued (position {job['queue_position']})"
        return job.get("total_steps"), job.get("step") or 0, info

    return follow_state(f"{url}/v1/train/jobs/{job_id}", job_id, progress)


def _submit(kind: str, url: str, body: dict[str, Any], wait: bool) -> None:
    job = request("POST", f"{url}/v1/train/{kind}", json=body)
    typer.echo(f"submitted {job['id']} (adapter {job['adapter']!r})")
    if not wait:
        return
    job = follow(url, job["id"])
    if job["state"] != "succeeded":
        fail(f"job {job['id']} {job['state']}: {job.get('error')}")
    res = job["result"]
    typer.echo(f"published {res['adapter']} revision {res['revision'][:12]}"
               + (" (serving now)" if res["activated"] else "") + f" in {res['timings_s']['total']:.2f}s")
    for line in locality_lines(res.get("locality") or {}):
        typer.echo(line)
    held = res.get("held_back")
    if held and str(held.get("code", "")).startswith("locality_"):  # the locality guard
        typer.echo(f"not served: {held['reason']} (serve it anyway: kiln adapters load {res['adapter']}, "
                   "or resubmit with --locality-override)", err=True)
    elif held:  # the activation was refused (quarantine, memory, a failed canary)
        typer.echo(f"not served ({held['code']}): {held['reason']} (kiln adapters load {res['adapter']} "
                   "once that is resolved)", err=True)


def locality_lines(loc: dict[str, Any]) -> list[str]:
    """What ``kiln train`` prints of a job's locality: the figures, and when scope "auto" published the adapter
    scoped, that it answers only questions about its corrections and why (docs/training.md, "Scoped corrections")."""
    if loc.get("unchanged_fraction") is None:
        return []
    lines = [f"locality: {loc['unchanged']} of {loc['probes']} probe answers unchanged, mean KL "
             f"{loc['kl_mean']:.4f} nats/token, {loc['degenerate']} made degenerate"]
    auto = loc.get("auto_scope")
    if auto:
        un = auto.get("unscoped") or {}
        lines.append(f"scoped to its corrections: it answers questions about them and the base model the rest "
                     f"(unscoped it kept {un.get('unchanged')} of {un.get('probes')} probe answers: {auto.get('reason')})")
    return lines


def _common(adapter: str, epochs: Optional[int], lr: Optional[float], rank: Optional[int], base: Optional[str],
            auto_load: bool, seed: int, batch_size: Optional[int]) -> dict[str, Any]:
    body: dict[str, Any] = {"adapter": adapter, "auto_load": auto_load, "seed": seed}
    for key, value in (("epochs", epochs), ("learning_rate", lr), ("lora_rank", rank), ("base_adapter", base),
                       ("batch_size", batch_size)):
        if value is not None:
            body[key] = value
    return body


def _not_distributed(kind: str, distributed: Optional[int]) -> None:
    if distributed is not None:
        fail(f"kiln train {kind} --distributed is not supported yet; only sft runs under torchrun (docs/scale.md)")


DistributedNotYet = typer.Option(None, "--distributed", help="not supported yet (sft only, docs/scale.md)")


@app.command()
def sft(
    file: Path = typer.Option(..., "--file", "-f", help="JSONL of {\"messages\": [...]} examples"),
    adapter: str = typer.Option(..., "--adapter", "-a", help="name to publish the adapter under"),
    url: str = UrlOpt,
    epochs: Optional[int] = typer.Option(None, help="default: enough for a short run (see docs/training.md)"),
    learning_rate: Optional[float] = typer.Option(None, "--lr"),
    rank: Optional[int] = typer.Option(None, "--rank"),
    base_adapter: Optional[str] = typer.Option(None, "--base-adapter", help="continue from this adapter"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    seed: int = typer.Option(0),
    auto_load: bool = typer.Option(True, "--auto-load/--no-auto-load", help="serve the adapter once trained"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the job with a progress bar"),
    distributed: Optional[int] = typer.Option(
        None, "--distributed", min=1, help="train here, without a server, in N torchrun processes (docs/scale.md)"),
    checkpoint_interval: Optional[int] = typer.Option(None, "--checkpoint-interval", min=0,
                                                      help="with --distributed: steps between checkpoints"),
    resume: Optional[str] = typer.Option(None, "--resume", help="with --distributed: continue this failed job"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", min=1,
                                                   help="with --distributed: rows per forward on each process"),
    home: Optional[str] = typer.Option(None, "--home", help="with --distributed: the Kiln home"),
    fsdp: bool = typer.Option(False, "--fsdp", help="with --distributed: shard the base model across the processes"),
    locality_override: bool = typer.Option(False, "--locality-override",
                                           help="serve it even when the locality guard would hold it back"),
    scope: Optional[str] = typer.Option(None, "--scope", help="corrections: the adapter answers only questions about "
                                        "its corrections, the base model the rest; auto: scoped only when the job's "
                                        "locality fails the guard unscoped; off; default: corrections when the base "
                                        "adapter is scoped, else auto"),
) -> None:
    """Train a LoRA adapter on chat examples (loss on assistant tokens)."""
    body = _common(adapter, epochs, learning_rate, rank, base_adapter, auto_load, seed, batch_size)
    if locality_override:
        body["locality"] = {"override": True}
    if scope is not None:
        body["scope"] = scope
    body["examples"] = read_json_rows(file)
    if distributed is not None:
        from kiln.training.run import launch

        body.pop("auto_load")  # nothing is served here: `kiln adapters load` serves the published adapter
        if checkpoint_interval is not None:
            body["checkpoint_interval"] = checkpoint_interval
        raise typer.Exit(launch(body, nproc=distributed, home=home, resume=resume, micro_batch_size=micro_batch_size,
                                fsdp=fsdp))
    if checkpoint_interval is not None or resume or micro_batch_size is not None or home or fsdp:
        fail("--checkpoint-interval, --resume, --micro-batch-size, --home and --fsdp apply with --distributed only")
    _submit("sft", url.rstrip("/"), body, wait)


@app.command()
def grpo(
    file: Optional[Path] = typer.Option(None, "--file", "-f",
                                        help="JSONL of {\"messages\", \"completions\": [{text, reward}]} (pre-scored)"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of {\"messages\", \"reference\"}: Kiln "
                                           "samples and scores the groups itself (needs --reward)"),
    reward: Optional[str] = typer.Option(None, "--reward", help="with --prompts: a reward as JSON, or @FILE, e.g. "
                                         "'{\"type\": \"scorer\", \"scorer\": {\"type\": \"exact\"}}'"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="with --prompts: completions per prompt"),
    iterations: Optional[int] = typer.Option(None, "--iterations", help="with --prompts: sample-score-update rounds"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="with --prompts: per completion"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="with --prompts: sampling temperature"),
    checkpoint_interval: int = typer.Option(0, "--checkpoint-interval", help="steps between checkpoints; 0: none"),
    resume: Optional[str] = typer.Option(None, "--resume", help="continue an interrupted job (its ID)"),
    adapter: str = typer.Option(..., "--adapter", "-a"),
    url: str = UrlOpt,
    epochs: Optional[int] = typer.Option(None),
    learning_rate: Optional[float] = typer.Option(None, "--lr"),
    rank: Optional[int] = typer.Option(None, "--rank"),
    base_adapter: Optional[str] = typer.Option(None, "--base-adapter"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    seed: int = typer.Option(0),
    kl_coef: float = typer.Option(0.0, "--kl-coef"),
    kl_estimator: str = typer.Option("k3", "--kl-estimator", help="k1 or k3"),
    auto_load: bool = typer.Option(False, "--auto-load/--no-auto-load"),
    wait: bool = typer.Option(True, "--wait/--no-wait"),
    distributed: Optional[int] = DistributedNotYet,
) -> None:
    """Train a LoRA adapter with GRPO: on scored completion groups (--file), or on groups Kiln samples for
    --prompts and scores with --reward (docs/training.md, "GRPO with rollouts")."""
    _not_distributed("grpo", distributed)
    if (file is None) == (prompts is None):
        fail("give exactly one of --file (pre-scored groups) or --prompts with --reward")
    body = _common(adapter, epochs, learning_rate, rank, base_adapter, auto_load, seed, batch_size)
    body.update(kl_coef=kl_coef, kl_estimator=kl_estimator)
    if checkpoint_interval:
        body["checkpoint_interval"] = checkpoint_interval
    if resume is not None:
        body["resume_from_job"] = resume
    rollout = {"group_size": group_size, "iterations": iterations, "max_tokens": max_tokens,
               "temperature": temperature}
    if file is not None:
        if reward is not None or any(v is not None for v in rollout.values()):
            fail("--reward, --group-size, --iterations, --max-tokens and --temperature apply with --prompts only")
        body["groups"] = read_json_rows(file)
    else:
        assert prompts is not None
        if reward is None:
            fail("--prompts needs --reward")
        body.update(prompts=read_json_rows(prompts), reward=_reward_spec(reward),
                    **{k: v for k, v in rollout.items() if v is not None})
    _submit("grpo", url.rstrip("/"), body, wait)


def _reward_spec(text: str) -> dict[str, Any]:
    """``--reward``: inline JSON, or ``@path`` to a JSON file."""
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text("utf-8")
        except OSError as exc:
            fail(f"cannot read {path}: {exc}")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"--reward is not JSON: {exc}")
    if not isinstance(spec, dict):
        fail("--reward must be a JSON object such as {\"type\": \"scorer\", \"scorer\": {\"type\": \"exact\"}}")
    return spec


@app.command()
def status(url: str = UrlOpt) -> None:
    """Show the running job, the queue and recent jobs."""
    from rich.console import Console
    from rich.table import Table

    st = request("GET", f"{url.rstrip('/')}/v1/train/status")
    table = Table(title=f"training queue ({len(st['queued'])}/{st['queue_max']} queued)")
    for col in ("job", "kind", "adapter", "state", "step", "loss", "tok/s", "ETA s", "note"):
        table.add_column(col)
    jobs = list(st["recent"]) + ([st["running"]] if st["running"] else []) + list(st["queued"])
    for j in jobs:
        step = f"{j.get('step') or 0}/{j.get('total_steps') or '?'}"
        loss = f"{j['loss']:.4f}" if j.get("loss") is not None else ""
        note = j.get("error") or (f"position {j['queue_position']}" if j.get("queue_position") else "")
        prog = j.get("progress") or {}
        if not note and "teacher_s" in prog:  # OPD: where the time goes
            note = f"teacher {prog['teacher_s']}s / student {prog.get('student_s')}s / step {prog.get('step_s')}s"
        table.add_row(j["id"], j["kind"], j["adapter"], j["state"], step, loss,
                      str(j.get("tokens_per_s") or ""), str(j.get("eta_s") or ""), (note or "")[:60])
    Console().print(table)


@app.command()
def cancel(job_id: str, url: str = UrlOpt) -> None:
    """Cancel a queued job, or stop a running one at its next step."""
    job = request("DELETE", f"{url.rstrip('/')}/v1/train/queue/{job_id}")
    typer.echo(f"{job['id']}: {job['state']}" + (" (stopping at the next step)" if job["state"] == "running" else ""))


@app.command()
def opd(
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="JSONL of {\"messages\": [...]} prompts "
                                        "(optional \"teacher_messages\", \"gold\")"),
    teacher_jsonl: Optional[str] = typer.Option(None, "--teacher-jsonl", help="off-policy instead: a teacher JSONL "
                                                "(built from the alias's off_policy_manifest), relative to the "
                                                "server's data dir"),
    adapter: str = typer.Option(..., "--adapter", "-a"),
    teacher: str = typer.Option(..., "--teacher", "-t", help="a registered teacher alias (`kiln teachers list`)"),
    url: str = UrlOpt,
    steps: Optional[int] = typer.Option(None, "--steps"),
    learning_rate: Optional[float] = typer.Option(None, "--lr"),
    rank: Optional[int] = typer.Option(None, "--rank"),
    base_adapter: Optional[str] = typer.Option(None, "--base-adapter"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="prompts per step"),
    samples_per_prompt: int = typer.Option(4, "--samples"),
    max_tokens: int = typer.Option(32, "--max-tokens"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="the student's sampling temperature "
                                                "(default: the server's, 0.5)"),
    top_k: int = typer.Option(8, "--top-k"),
    loss: Optional[str] = typer.Option(None, "--loss", help="forward (the server's default), tail, renormalized "
                                       "or sampled_token"),
    ce_weight: Optional[float] = typer.Option(None, "--ce-weight", help="CE on each prompt's `gold`, else on the "
                                              "teacher's greedy answer (default: the server's, 3 with the teacher "
                                              "path)"),
    rehearsal: Optional[int] = typer.Option(None, "--rehearsal", help="questions the base model writes for "
                                            "rehearsal rows (default: the server's, 64; 0: off)"),
    seed: int = typer.Option(0),
    auto_load: bool = typer.Option(False, "--auto-load/--no-auto-load"),
    wait: bool = typer.Option(True, "--wait/--no-wait"),
    distributed: Optional[int] = DistributedNotYet,
) -> None:
    """On-policy distillation: the adapter samples, the teacher scores, the adapter moves toward the teacher."""
    _not_distributed("opd", distributed)
    body = _common(adapter, None, learning_rate, rank, base_adapter, auto_load, seed, batch_size)
    if (file is None) == (teacher_jsonl is None):
        raise typer.BadParameter("give --file (on-policy prompts) or --teacher-jsonl (off-policy corpus)")
    body.update(teacher=teacher, top_k=top_k)
    if loss is not None:
        body["loss"] = loss
    if teacher_jsonl is not None:
        body.update(training_mode="off_policy", teacher_jsonl=teacher_jsonl)
    else:
        assert file is not None
        body.update(prompts=read_json_rows(file), samples_per_prompt=samples_per_prompt, max_tokens=max_tokens)
        if ce_weight is not None:
            body["ce_weight"] = ce_weight
        if temperature is not None:
            body["temperature"] = temperature
        if rehearsal is not None:
            body["rehearsal"] = rehearsal
    if steps is not None:
        body["steps"] = steps
    _submit("opd", url.rstrip("/"), body, wait)


@app.command()
def kd(
    run: str = typer.Option(..., "--run", "-r", help="capture run root (`kiln distill capture --out`), relative to "
                            "the server's data dir"),
    adapter: str = typer.Option(..., "--adapter", "-a"),
    url: str = UrlOpt,
    epochs: Optional[int] = typer.Option(None, help="passes over each shard (more than 1: chained replays)"),
    learning_rate: Optional[float] = typer.Option(None, "--lr"),
    rank: Optional[int] = typer.Option(None, "--rank"),
    base_adapter: Optional[str] = typer.Option(None, "--base-adapter"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="captured sequences per step"),
    ce_weight: float = typer.Option(1.0, "--ce-weight"),
    kd_weight: float = typer.Option(1.0, "--kd-weight"),
    replay: bool = typer.Option(False, "--replay/--no-replay", help="consume already-committed shards again "
                                "(chained replay)"),
    seed: int = typer.Option(0),
    auto_load: bool = typer.Option(False, "--auto-load/--no-auto-load"),
    wait: bool = typer.Option(True, "--wait/--no-wait"),
    distributed: Optional[int] = DistributedNotYet,
) -> None:
    """Sparse KD from an offline capture: train the served model's adapter, each shard consumed once."""
    _not_distributed("kd", distributed)
    body = _common(adapter, epochs, learning_rate, rank, base_adapter, auto_load, seed, batch_size)
    body.update(run=run, ce_weight=ce_weight, kd_weight=kd_weight, replay=replay)
    _submit("kd", url.rstrip("/"), body, wait)
