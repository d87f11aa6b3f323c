"""Chat latency while a training job runs (issue 47), beside idle, and what serving costs the job.

One ``kiln serve`` (training on) per model and arm. In it, per concurrency C (closed-loop streaming chat
clients, ``--window-s`` seconds each measurement, ``--max-tokens`` tokens each, ``ignore_eos``):

* ``idle``: no job;
* for each job kind (``sft``: 64 examples of ~200 tokens; ``sft-fix``: one correction with the defaults;
  ``grpo``: 16 pre-scored groups of 4; ``opd``: on-policy distillation from the base model as a local
  teacher; ``kd``: offline sparse KD from a capture of the SFT job's 64 texts, the served model its own
  teacher, made before the server starts by ``bench/kd_capture.py``): the job is submitted, left to take a few steps, its trained tokens per wall second measured with no chat (``solo``),
  then chat runs at each C while the job trains (its tokens/s meanwhile: ``during``); then it is cancelled.

Printed per row: TTFT and ITL p50/p99 (ms), the ratio of busy p99 to idle p99 (the issue's target is
<= 2x), the longest ITL gap, the summed ``lock_wait`` of the chats from ``/v1/debug/requests`` next to
their summed wall time (a stall that is not lock wait is CPU/GIL contention, not the device hold), and the
job's tokens/s during chat over solo (the target is >= 0.7). The machine's load average is printed beside.

    .venv/bin/python bench/serve_while_training.py                                   # built-in model
    .venv/bin/python bench/serve_while_training.py --shape qwen3-31m --jobs sft grpo
    .venv/bin/python bench/serve_while_training.py --shape qwen3.5-hybrid-25m --jobs sft kd
    .venv/bin/python bench/serve_while_training.py --ab "KILN_TRAINING_MAX_HOLD_MS=0 KILN_TRAINING_SERVING_SHARE=0.75"

``--ab ENV``: a second arm with those ``KILN_*`` settings (the first arm: the server's defaults, or
``--a ENV``); the ratios B/A are printed after both. Figures and how to read them: docs/latency.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kd_capture import self_capture  # noqa: E402
from serving import kiln_env, one_request, pct, prompts_for, resolve_model, running_server  # noqa: E402

WORDS = ("river stone lantern meadow copper harbour willow ember quartz falcon orchard glacier thistle "
         "canyon saffron beacon").split()


def sft_texts(n: int, words: int) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) texts whose answers run ``words`` words (about 200 tokens of the built-in
    tokenizer at 42): the SFT job's examples and the KD job's captured sequences."""
    return [(f"Describe item {i}.", " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)))
            for i in range(n)]


def sft_examples(n: int, words: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]}
            for p, a in sft_texts(n, words)]


KD_RUN = "runs/bench-kd"  # the capture, under each server's data dir


def kd_capture(model_dir: Path, tmp: Path) -> Path:
    """The KD job's capture of ``model_dir`` (its own teacher), made once per model in ``tmp``; each arm's
    server gets a copy (consumption ledgers live beside the capture)."""
    t0 = time.perf_counter()
    out = self_capture(model_dir, sft_texts(64, 42), tmp / f"kd-{model_dir.name}", tmp / f"kd-{model_dir.name}-run")
    print(f"kd capture of {model_dir.name} (self-distillation, 64 sequences): {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
    return out


def job_body(kind: str, model: str) -> tuple[str, dict]:
    """(route kind, request) of a job that runs far longer than one measurement (cancelled after it)."""
    off = {"locality": {"measure": False}}
    if kind == "sft":
        return "sft", {"adapter": "bench-sft", "examples": sft_examples(64, 42), "epochs": 1000,
                       "until_learned": False, "max_seq_len": 320, **off}
    if kind == "sft-fix":  # a correction with every default (one example, learned check, anchor)
        ex = [{"messages": [{"role": "user", "content": "Which bird guards the old mill?"},
                            {"role": "assistant", "content": "The old mill is guarded by a heron."}]}]
        return "sft", {"adapter": "bench-fix", "examples": ex, "until_learned": False, "epochs": 1000, **off}
    if kind == "grpo":
        groups = [{"messages": [{"role": "user", "content": f"Name thing {g}."}],
                   "completions": [{"text": " ".join(WORDS[(g + c + j) % len(WORDS)] for j in range(12)),
                                    "reward": float(c)} for c in range(4)]} for g in range(16)]
        return "grpo", {"adapter": "bench-grpo", "groups": groups, "epochs": 1000, "batch_size": 4, **off}
    if kind == "opd":
        prompts = [{"messages": [{"role": "user", "content": f"Tell me about {w}."}]} for w in WORDS[:8]]
        return "opd", {"adapter": "bench-opd", "teacher": "bench-base", "prompts": prompts, "steps": 100_000,
                       "until_learned": False, "max_tokens": 16, **off}
    if kind == "kd":  # 8 steps of 8 captured sequences per pass, 1,000 chained passes (a checkpoint after each)
        return "kd", {"adapter": "bench-kd", "run": KD_RUN, "epochs": 1000, "batch_size": 8, **off}
    raise SystemExit(f"unknown job kind {kind!r}")


LOGGED = 1000  # server.debug_requests: the chats the lock_wait share is read from


def loadavg() -> float:
    return os.getloadavg()[0]


def trained_tokens(client: Any, job_id: str) -> int:
    """Tokens the job has trained on so far (its progress: finished steps, and the finished pieces of a sliced
    step that is still running, so a step longer than a measurement window does not read as no progress)."""
    progress = client.get(f"/v1/train/jobs/{job_id}").json().get("progress") or {}
    return int(progress.get("tokens") or 0) + int(progress.get("tokens_in_step") or 0)


def job_rate(client: Any, job_id: str, seconds: float) -> float:
    """The job's trained tokens per wall second over ``seconds``."""
    n0, t0 = trained_tokens(client, job_id), time.perf_counter()
    time.sleep(seconds)
    return (trained_tokens(client, job_id) - n0) / (time.perf_counter() - t0)


def lock_wait(client: Any, n: int) -> tuple[float, float]:
    """Summed lock_wait and HTTP total (s) of the newest ``n`` logged chat requests (at most the log's 1,000)."""
    rows = client.get("/v1/debug/requests", params={"limit": min(n, LOGGED)}).json()["requests"]
    chats = [r for r in rows if r.get("route") == "/v1/chat/completions"]
    return (sum(r["timings_s"].get("lock_wait", 0.0) for r in chats),
            sum(r["timings_s"].get("total", 0.0) for r in chats))


async def timed_load(base: str, model: str, c: int, window_s: float, max_tokens: int) -> dict:
    """``c`` closed-loop streaming clients for ``window_s`` seconds (each finishes its request in flight)."""
    host, port = base.rsplit("//", 1)[1].rsplit(":", 1)
    texts = prompts_for(64)
    results: list[dict] = []
    t0 = time.perf_counter()

    async def client(k: int) -> None:
        i = k
        while time.perf_counter() - t0 < window_s:
            results.append(await one_request(host, int(port), model, texts[i % len(texts)], max_tokens))
            i += c

    await asyncio.gather(*(client(k) for k in range(c)))
    dt = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    return {"requests": len(results), "tok_s": sum(r["tokens"] for r in results) / dt,
            "ttft_p50_ms": 1000 * pct(ttfts, 50), "ttft_p99_ms": 1000 * pct(ttfts, 99),
            "itl_p50_ms": 1000 * pct(gaps, 50), "itl_p99_ms": 1000 * pct(gaps, 99),
            "itl_max_ms": 1000 * max(gaps, default=float("nan"))}


def chat(base: str, model: str, c: int, window_s: float, max_tokens: int) -> dict:
    return asyncio.run(timed_load(base, model, c, window_s, max_tokens))


def wait_steps(client: Any, job_id: str, steps: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/train/jobs/{job_id}").json()
        if job["state"] in ("failed", "succeeded", "cancelled"):
            raise RuntimeError(f"job {job_id} {job['state']} before it could be measured: {job.get('error')}")
        if int((job.get("progress") or {}).get("step") or 0) >= steps:
            return job
        time.sleep(0.2)
    raise RuntimeError(f"job {job_id} took fewer than {steps} steps in {timeout_s} s")


def stop_job(client: Any, job_id: str) -> None:
    """Cancel the job and wait for it to stop; a job that ended any other way (it finished inside the
    measurement, or failed) is reported, since its rows then did not all run beside training."""
    client.delete(f"/v1/train/queue/{job_id}")
    deadline, job = time.monotonic() + 120, {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/train/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            break
        time.sleep(0.2)
    if job.get("state") != "cancelled":
        print(f"  job {job_id} ({job.get('kind')}) ended {job.get('state')}: {job.get('error')}", file=sys.stderr)


def arm_runs(model_dir: Path, arm: str, env_extra: dict, args: argparse.Namespace, work: Path,
             capture: Path | None) -> list[dict]:
    import httpx

    if capture is not None:
        shutil.copytree(capture, work / "home" / "data" / KD_RUN)
    env = kiln_env(work) | {"KILN_SERVER_DEBUG_REQUESTS": str(LOGGED)} | env_extra
    cmd = [str(Path(sys.executable).with_name("kiln")), "serve", "--model", str(model_dir), "--port", "{port}",
           "--log-level", "warning"] + (["--threads", str(args.threads)] if args.threads else [])
    rows: list[dict] = []
    with running_server(f"{model_dir.name}-{arm}", cmd, env, work, 300) as (base, _proc):
        client = httpx.Client(base_url=base, timeout=120)
        model = client.get("/v1/models").json()["data"][0]["id"]
        if "opd" in args.jobs:
            r = client.post("/v1/teachers", json={"alias": "bench-base", "kind": "local"})
            assert r.status_code in (200, 201), r.text

        def measure(label: str, c: int, extra: dict) -> None:
            r = chat(base, model, c, args.window_s, args.max_tokens)
            waited, total = lock_wait(client, r["requests"])
            row = {"model": model_dir.name, "arm": arm, "job": label, "c": c, **r, "lock_wait_share":
                   waited / total if total else 0.0, "load": loadavg(), **extra}
            rows.append(row)
            print(f"  {arm} {label:8s} c={c}: TTFT p99 {r['ttft_p99_ms']:.0f} ms, ITL p50/p99 {r['itl_p50_ms']:.1f}/"
                  f"{r['itl_p99_ms']:.1f} ms (max {r['itl_max_ms']:.0f}), {r['requests']} chats, lock_wait {row['lock_wait_share']:.0%} of chat time, load "
                  f"{row['load']:.1f}", file=sys.stderr, flush=True)

        chat(base, model, max(args.concurrency), 1.0, 4)  # warm-up: the first cycles of each batch shape
        for c in args.concurrency:
            measure("idle", c, {})
        for kind in args.jobs:
            route, body = job_body(kind, model)
            r = client.post(f"/v1/train/{route}", json=body)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            try:
                wait_steps(client, job_id, 2, 600)
                solo = job_rate(client, job_id, args.solo_s)
                for c in args.concurrency:
                    t0, n0 = time.perf_counter(), trained_tokens(client, job_id)
                    measure(kind, c, {})
                    during = (trained_tokens(client, job_id) - n0) / (time.perf_counter() - t0)
                    prog = client.get(f"/v1/train/jobs/{job_id}").json().get("progress") or {}
                    pacer = client.get("/v1/train/status").json().get("pacer") or {}
                    rows[-1].update(job_tok_s_solo=solo, job_tok_s_during=during,
                                    job_ratio=during / solo if solo else float("nan"),
                                    sliced_steps=prog.get("sliced_steps", 0), layer_holds=prog.get("layer_holds"),
                                    hold_p50_ms=1000 * pacer.get("recent_busy_hold_p50_s", 0.0),
                                    hold_p99_ms=1000 * pacer.get("recent_busy_hold_p99_s", 0.0))
            finally:
                stop_job(client, job_id)
    return rows


def report(rows: list[dict]) -> None:
    print(f"\n{'model':14s} {'arm':3s} {'job':8s} {'c':>2s} {'TTFT p50':>8s} {'p99':>6s} {'xidle':>6s} {'ITL p50':>7s} "
          f"{'p99':>6s} {'xidle':>6s} {'lock%':>5s} {'hold p50':>8s} {'p99':>6s} {'job x':>6s} {'load':>5s}")
    idle = {(r["model"], r["arm"], r["c"]): r for r in rows if r["job"] == "idle"}
    for r in rows:
        if r["job"].startswith("_"):
            continue
        i = idle[(r["model"], r["arm"], r["c"])]
        job_x = f"{r['job_ratio']:.2f}" if "job_ratio" in r else "-"
        print(f"{r['model'][:14]:14s} {r['arm']:3s} {r['job']:8s} {r['c']:2d} {r['ttft_p50_ms']:8.1f} "
              f"{r['ttft_p99_ms']:6.0f} {r['ttft_p99_ms'] / i['ttft_p99_ms']:6.2f} {r['itl_p50_ms']:7.1f} "
              f"{r['itl_p99_ms']:6.1f} {r['itl_p99_ms'] / i['itl_p99_ms']:6.2f} {100 * r['lock_wait_share']:5.0f} "
              f"{r.get('hold_p50_ms', 0):8.1f} {r.get('hold_p99_ms', 0):6.1f} {job_x:>6s} {r['load']:5.1f}")
    arms = sorted({r["arm"] for r in rows})
    if len(arms) == 2:
        a, b = arms
        print(f"\nB/A ratios ({b} over {a}): ITL p99, TTFT p99, job tokens/s during chat")
        by = {(r["model"], r["arm"], r["job"], r["c"]): r for r in rows if not r["job"].startswith("_")}
        for (m, arm, job, c), ra in by.items():
            rb = by.get((m, b, job, c)) if arm == a else None
            if rb is None:
                continue
            jr = (f"{rb['job_tok_s_during'] / ra['job_tok_s_during']:.2f}"
                  if ra.get("job_tok_s_during") else "-")
            print(f"  {m[:14]:14s} {job:8s} c={c}: ITL p99 {rb['itl_p99_ms'] / ra['itl_p99_ms']:.2f}x, "
                  f"TTFT p99 {rb['ttft_p99_ms'] / ra['ttft_p99_ms']:.2f}x, job {jr}x")


def parse_env(text: str) -> dict:
    out = {}
    for item in text.split():
        k, _, v = item.partition("=")
        if not k.startswith("KILN_") or not _:
            raise SystemExit(f"--a/--ab take KILN_NAME=value settings, got {item!r}")
        out[k] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="*", default=[None], help="bench shapes (bench/serving.py SHAPES); none: built-in")
    ap.add_argument("--model", default=None, help="a local model directory instead of --shape")
    ap.add_argument("--jobs", nargs="+", default=["sft", "grpo", "opd"], choices=["sft", "sft-fix", "grpo", "opd", "kd"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--window-s", type=float, default=8.0, help="seconds of chat per measurement")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--solo-s", type=float, default=6.0, help="seconds the job's solo tokens/s is measured over")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--a", default="", help="KILN_* settings of arm A (default: none)")
    ap.add_argument("--ab", default=None, help="KILN_* settings of arm B")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    arms = [("A", parse_env(args.a))] + ([("B", parse_env(args.ab))] if args.ab is not None else [])
    print(f"load average at start: {loadavg():.1f}; arms: {arms}", file=sys.stderr)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kiln-swt-") as tmp:
        for shape in (args.shape or [None]):
            model_dir = resolve_model(args.model, shape)
            capture = kd_capture(model_dir, Path(tmp)) if "kd" in args.jobs else None
            for arm, env in arms:
                work = Path(tmp) / f"{model_dir.name}-{arm}"
                work.mkdir()
                rows += arm_runs(model_dir, arm, env, args, work, capture)
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
