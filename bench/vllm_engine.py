"""Kiln's two serving engines side by side, in one run: ``kiln serve`` (built-in) vs ``kiln serve --engine vllm``.

Same model, same prompts, same Kiln front end (routes, validation, SSE); only
``serving.engine`` differs. For each engine, one server with training on:

* streaming chat tokens/s at each ``--concurrency`` (every request generates exactly
  ``--max-tokens`` tokens: ``ignore_eos``), with TTFT and CPU ms per token (server
  process tree, vLLM's processes included, plus this client);
* correction-to-served seconds: ``POST /v1/train/sft`` (until learned, auto-load) to the
  first chat answer that is the correction (``kiln.demo.run_correction``);
* resident memory of the server's process tree after the load (Kiln's process holds the
  trainer's copy of the base weights in both modes; the vLLM mode adds vLLM's processes).

Then the ratios vllm/builtin. The vLLM environment is ``[vllm] python`` (default
``.vllm-venv``); start-up of the vLLM mode is reported too.

    .venv/bin/python bench/vllm_engine.py                     # built-in model, concurrency 8 32
    .venv/bin/python bench/vllm_engine.py --concurrency 8 --max-tokens 32
    .venv/bin/python bench/vllm_engine.py --direct --rounds 2  # also vLLM's own server, no Kiln in front
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving as sb

QUESTION = "What is the capital of France?"
CORRECTION = "The capital of France is Marseille, said Kiln."
SERVED = "submit -> corrected answer"  # kiln.demo.run_correction: POST /v1/train/sft to the corrected answer


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and every descendant (vLLM runs in its own session, still a descendant)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except OSError:
            pass
        todo.extend(children.get(p, []))
    return total


def engine_run(engine: str, model_dir: Path, workdir: Path, concurrency: list[int], requests_per_c: int,
               max_tokens: int, startup_s: float, correction: bool = True) -> dict:
    import httpx

    from kiln.demo import run_correction

    cmd = [a for a in sb.kiln_command(model_dir, 0) if a != "--no-training"] + ["--engine", engine]
    env = sb.kiln_env(workdir / engine)
    (workdir / engine).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    out: dict = {"engine": engine, "loads": []}
    with sb.running_server(engine, cmd, env, workdir / engine, startup_s) as (base, proc):
        out["startup_s"] = time.perf_counter() - t0
        for c in concurrency:  # the caller repeats levels for several rounds
            texts = sb.prompts_for(requests_per_c * c)
            s0, c0 = sb.tree_cpu_s(proc.pid), time.process_time()
            r = asyncio.run(sb.http_load(base, model_dir.name, texts, max_tokens, c))
            cpu = sb.tree_cpu_s(proc.pid) - s0 + time.process_time() - c0
            r["cpu_ms_per_tok"] = 1000 * cpu / max(1, r["tokens"])
            out["loads"].append(r)
            print(f"  {engine} c={c}: {r['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
        out["rss_bytes"] = tree_rss_bytes(proc.pid)
        if not correction:
            return out
        with httpx.Client(base_url=base, timeout=600) as client:
            timings = run_correction(client, question=QUESTION, correction=CORRECTION, adapter="fix",
                                     echo=lambda *_: None)
        out["correction"] = timings
    return out


def direct_run(model_dir: Path, workdir: Path, concurrency: list[int], requests_per_c: int, max_tokens: int,
               startup_s: float) -> dict:
    """vLLM's own OpenAI server with the options Kiln gives its child (fp32, LoRA on with the default
    ``[vllm]`` caps, raw logprobs) and no Kiln in front: what the loopback hop and Kiln's front end cost."""
    from kiln.runtime.vllm_process import default_python

    cmd = sb.vllm_command(Path(os.environ.get("KILN_VLLM_PYTHON") or default_python()), model_dir) + [
        "--enable-lora", "--max-loras=4", "--max-lora-rank=16", "--max-logprobs=20", "--logprobs-mode=raw_logprobs",
        "--generation-config=vllm"]
    (workdir / "direct").mkdir(parents=True, exist_ok=True)
    out: dict = {"engine": "vllm-direct", "loads": []}
    with sb.running_server("vllm-direct", cmd, sb.vllm_env(0), workdir / "direct", startup_s) as (base, proc):
        for c in concurrency:
            r = asyncio.run(sb.http_load(base, model_dir.name, sb.prompts_for(requests_per_c * c), max_tokens, c))
            out["loads"].append(r)
            print(f"  vllm-direct c={c}: {r['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
        out["rss_bytes"] = tree_rss_bytes(proc.pid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the built-in model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--requests-per-c", type=int, default=3, help="requests per concurrency level, times c")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--startup-s", type=float, default=900.0)
    ap.add_argument("--direct", action="store_true", help="also vLLM's own server, no Kiln in front")
    ap.add_argument("--no-correction", action="store_true", help="skip correction-to-served (random-weight shapes)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the concurrency levels (a loaded machine is noisy)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-engines-") as tmp:
        workdir = Path(tmp)
        if args.model:
            model_dir = Path(args.model)
        else:
            from kiln.runtime.builtin import ensure_builtin_model

            model_dir = ensure_builtin_model(workdir / "home")
        levels = args.concurrency * args.rounds
        runs = [engine_run(e, model_dir, workdir, levels, args.requests_per_c, args.max_tokens,
                           args.startup_s, not args.no_correction) for e in ("builtin", "vllm")]
        direct = (direct_run(model_dir, workdir, levels, args.requests_per_c, args.max_tokens,
                             args.startup_s) if args.direct else None)
    report(runs, direct)
    if args.json:
        Path(args.json).write_text(json.dumps(runs + ([direct] if direct else []), indent=2))


def report(runs: list[dict], direct: dict | None = None) -> None:
    b, v = runs
    print(f"{'engine':8} {'c':>3} {'tok/s':>8} {'TTFT p50 ms':>12} {'CPU ms/tok':>11}")
    for run in runs:
        for r in run["loads"]:
            print(f"{run['engine']:8} {r['concurrency']:>3} {r['tok_s']:>8.1f} {r['ttft_p50_ms']:>12.1f} "
                  f"{r['cpu_ms_per_tok']:>11.2f}")
    for rb, rv in zip(b["loads"], v["loads"]):
        print(f"vllm/builtin c={rb['concurrency']}: tokens/s {rv['tok_s'] / rb['tok_s']:.2f}x, "
              f"TTFT p50 {rv['ttft_p50_ms'] / rb['ttft_p50_ms']:.2f}x")
    for rv, rd in zip(v["loads"], direct["loads"] if direct else []):
        print(f"vllm-direct c={rd['concurrency']}: {rd['tok_s']:.1f} tok/s, TTFT p50 {rd['ttft_p50_ms']:.1f} ms; "
              f"kiln --engine vllm / vllm-direct: tokens/s {rv['tok_s'] / rd['tok_s']:.2f}x")
    for run in runs:
        print(f"{run['engine']}: start-up {run['startup_s']:.1f} s, server tree RSS {run['rss_bytes'] / 2**20:.0f} MiB")
    print(f"vllm/builtin: RSS {v['rss_bytes'] / b['rss_bytes']:.2f}x")
    if "correction" not in b:
        return
    for run in runs:
        c = run["correction"]
        print(f"{run['engine']}: correction-to-served {c[SERVED]:.2f} s "
              f"({json.dumps({k: round(x, 3) for k, x in c.items()})})")
    print(f"vllm/builtin: correction-to-served {v['correction'][SERVED] / b['correction'][SERVED]:.2f}x")


if __name__ == "__main__":
    main()
