"""``kiln serve`` over a float32 base vs ``--quantize int8`` vs ``--quantize int4``, side by side.

Builds (or reuses) a random-weight Qwen3 shape of bench/serving.py (default ``qwen3-31m``: hidden
512, 8 layers, the built-in tokenizer), prints the probe set's mean per-token KL(f32 || int8/int4)
and the quantized weight bytes (in process, kiln.runtime.quantize), then runs the three servers
through bench/serving.py's interleaved A/B runner (``--rounds`` rounds, the order flipped every
round) at ``--concurrency`` (default 8) and prints tokens/s, CPU per token and the ratios to f32.
llama.cpp is not a peer here (it is not built on the project's machines; see docs/serving.md).

    .venv/bin/python bench/quantized.py                       # qwen3-31m, c=8, 1 round
    .venv/bin/python bench/quantized.py --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("int8", "int4")


def probe(model_dir: Path) -> dict[str, dict]:
    """The load-time report of each mode (KL, bytes) on this model, in process."""
    from kiln.runtime.loader import load_model
    from kiln.runtime.quantize import quantize_loaded

    out = {}
    for mode in MODES:
        loaded = load_model(model_dir, device="cpu")
        out[mode] = quantize_loaded(loaded, mode, None).as_dict()
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from serving import SHAPES, ab_runs, build_shape_model, kiln_command, kiln_env, prompts_for

    from kiln.config import kiln_home

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-31m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--waves", type=int, default=4, help="requests per run = waves x concurrency")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="kiln serve --threads (0: its default)")
    args = ap.parse_args()

    model_dir = build_shape_model(args.shape, kiln_home())
    for mode, rep in probe(model_dir).items():
        print(f"{mode}: probe KL {rep['probe_kl']:.2e} nats/token over {rep['probe_tokens']} tokens, weights "
              f"{rep['weight_bytes_before'] / 2**20:.1f} -> {rep['weight_bytes_after'] / 2**20:.1f} MiB, "
              f"kernel {rep['kernel']}, layers {rep['layers']}")
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-quant-"))
    env, cmd = kiln_env(workdir), kiln_command(model_dir, args.threads)
    arms = [("f32", cmd, env)] + [(m, cmd + ["--quantize", m], env) for m in MODES]
    texts_by_c = {c: prompts_for(max(8, args.waves * c)) for c in args.concurrency}
    runs = ab_runs(model_dir, workdir, arms, texts_by_c, args.max_tokens, args.rounds)
    print(f"{'base':<6}{'round':>6}{'c':>4}{'tok/s':>8}{'CPU ms/tok':>11}{'ITL p50':>9}  (ms)")
    for r in runs:
        print(f"{r['setting']:<6}{r['round']:>6}{r['concurrency']:>4}{r['tok_s']:>8.0f}{r['cpu_ms_per_tok']:>11.3f}"
              f"{r['itl_p50_ms']:>9.2f}")
    for c in args.concurrency:
        best = {label: max(r["tok_s"] for r in runs if r["setting"] == label and r["concurrency"] == c)
                for label, _, _ in arms}
        cpu = {label: min(r["cpu_ms_per_tok"] for r in runs if r["setting"] == label and r["concurrency"] == c)
               for label, _, _ in arms}
        print(f"c={c}: best tok/s " + ", ".join(f"{k} {v:.0f}" for k, v in best.items()) + "; vs f32: "
              + ", ".join(f"{m} {best[m] / best['f32']:.2f}x tok/s, {cpu['f32'] / cpu[m]:.2f}x CPU/tok" for m in MODES))


if __name__ == "__main__":
    main()
