"""`kiln demo`: the correction loop end to end on the built-in model.

Starts ``kiln serve`` (a subprocess on a free loopback port), asks a question,
submits one correction as an SFT job with ``auto_load``, waits for it, asks
again with ``"model": <adapter>`` and prints how long every step took. A job is
judged by both halves of what the user sees: the corrected answer, and the
model's other answers kept (the job's locality figures, and a control question
asked of the base model before and of the adapter after).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer

from kiln.adapters.manifest import ADAPTER_REVISION_HEADER
from kiln.training.cli import locality_lines

QUESTION = "How many legs does an ant have?"
CORRECTION = "An ant has six legs."
CONTROL = "What is the capital of France?"  # a question the correction is not about: its answer should stay
ADAPTER = "demo-correction"
STARTUP_TIMEOUT_S = 300.0  # the first run builds the built-in model (~20 s on 2 cores)
JOB_TIMEOUT_S = 120.0
POLL_S = 0.05
STOP_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(client: Any, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`kiln serve` exited with code {proc.returncode} before it was ready")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"`kiln serve` was not ready within {timeout:.0f} s")


def _ask(client: Any, model: str, question: str) -> tuple[str, str | None]:
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 32})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"], r.headers.get(ADAPTER_REVISION_HEADER)


@dataclass
class RunningServer:
    client: Any  # httpx.Client with base_url set
    process: Any  # subprocess.Popen, or what the caller's popen returns
    url: str


@contextmanager
def kiln_server(home: Path | None, *, extra_env: dict[str, str] | None = None,
                timeout: float = STARTUP_TIMEOUT_S, popen: Callable[..., Any] = subprocess.Popen,
                ) -> Iterator[RunningServer]:
    """Run ``kiln serve`` on a free loopback port and yield it (with an ``httpx.Client``).

    The server's output goes to a temp file whose tail is printed to stderr if
    the server dies or fails to start. It is stopped with SIGINT (then killed). ``popen`` starts the
    process (``subprocess.Popen``'s signature; the test suite passes one that forks a pre-imported
    interpreter).
    """
    import httpx

    port = _free_port()
    env = dict(os.environ)
    if home is not None:
        env["KILN_HOME"] = str(home)
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    log = tempfile.TemporaryFile(mode="w+")
    proc = popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    ok = False
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60.0) as client:
            _wait_ready(client, proc, timeout)
            yield RunningServer(client, proc, url)
            ok = True
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not ok:
            log.seek(0)
            print(f"kiln serve output (tail):\n{log.read()[-3000:]}", file=sys.stderr)
        log.close()


def wait_job(client: Any, job_id: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """Poll a training job until it is terminal."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/train/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        if time.monotonic() > deadline:
            raise RuntimeError(f"training job {job_id} did not finish within {timeout:.0f} s")
        time.sleep(POLL_S)


def correction_body(adapter: str, question: str, correction: str) -> dict[str, Any]:
    """An SFT request that trains until ``correction`` is the greedy answer (at most a few hundred steps)."""
    return {"adapter": adapter, "auto_load": True, "until_learned": True, "examples": [{"messages": [
        {"role": "user", "content": question}, {"role": "assistant", "content": correction}]}]}


def run_correction(client: Any, *, question: str, correction: str, adapter: str, control: str | None = CONTROL,
                   echo: Any = print) -> dict[str, float]:
    """Ask, correct, ask again on a running server; return the step timings in seconds. ``control``, a question
    the correction is not about, is asked of the base model before and of the adapter after: what the user
    sees of the model's other answers, beside the job's locality figures."""
    timings: dict[str, float] = {}
    base = client.get("/v1/models").json()["data"][0]["id"]
    t = time.perf_counter()
    before, _ = _ask(client, base, question)
    timings["ask (base model)"] = time.perf_counter() - t
    echo(f"\nQ: {question}\nA ({base}): {before}")
    control_before = _ask(client, base, control)[0] if control else None

    echo(f"\ncorrecting it: {correction!r} -> adapter {adapter!r}")
    t_submit = time.perf_counter()
    r = client.post("/v1/train/sft", json=correction_body(adapter, question, correction))
    if r.status_code != 202:
        raise RuntimeError(f"submitting the correction failed: {r.status_code} {r.text}")
    job = wait_job(client, r.json()["id"])
    if job["state"] != "succeeded":
        raise RuntimeError(f"the correction job {job['state']}: {job.get('error')}")
    held = job["result"].get("held_back")
    if held:  # published, not served: the locality guard (docs/training.md, "Locality") or the activation says why
        raise RuntimeError(f"the correction was learned and published but not served ({held['code']}): "
                           f"{held['reason']}")
    timings["train + publish + hot-swap"] = time.perf_counter() - t_submit

    t = time.perf_counter()
    after, revision = _ask(client, adapter, question)
    timings["ask (corrected adapter)"] = time.perf_counter() - t
    timings["submit -> corrected answer"] = time.perf_counter() - t_submit
    echo(f"\nQ: {question}\nA ({adapter} @ {str(revision)[:12]}): {after}")
    rep = job["result"]["report"]
    server_side = job["result"]["timings_s"]
    learned = "learned" if rep.get("learned") else "NOT learned"
    echo(f"({rep['steps']} steps, {learned} (greedy margin {rep.get('greedy_margin')}), final loss "
         f"{rep['final_loss']:.4f}; server-side: "
         + ", ".join(f"{k} {server_side[k]:.2f}s" for k in ("prepare", "train", "publish", "activate", "total")) + ")")
    for line in locality_lines(job["result"].get("locality") or {}):
        echo(line)
    if after.strip() != correction.strip() or not rep.get("learned"):
        echo("warning: the adapter's answer differs from the correction")
    if control:
        control_after, _ = _ask(client, adapter, control)
        kept = "unchanged" if control_after == control_before else f"changed; the base model said: {control_before}"
        echo(f"\nQ: {control}  (not corrected)\nA ({adapter}): {control_after}  [{kept}]")
    return timings


def demo(
    home: Optional[Path] = typer.Option(None, "--home", help="KILN_HOME for the demo server (default: $KILN_HOME)"),
    question: str = typer.Option(QUESTION, help="the question to ask"),
    correction: str = typer.Option(CORRECTION, help="the answer to teach"),
    adapter: str = typer.Option(ADAPTER, help="name of the correction adapter"),
    control: str = typer.Option(CONTROL, help="a question the correction is not about, asked before and after "
                                              "(empty: skip it)"),
) -> None:
    """Start Kiln on the built-in model, ask, correct, ask again; print each step's time."""
    typer.echo("starting kiln serve on the built-in model (the first run builds it) ...")
    t0 = time.perf_counter()
    try:
        with kiln_server(home) as server:
            timings = {"server start": time.perf_counter() - t0}
            timings |= run_correction(server.client, question=question, correction=correction, adapter=adapter,
                                      control=control or None, echo=typer.echo)
    except RuntimeError as exc:
        typer.secho(f"demo failed: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo("\nstep timings:")
    for name, seconds in timings.items():
        typer.echo(f"  {name:<28} {seconds:7.2f} s")
