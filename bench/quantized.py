"""``kiln serve`` over a float32 base vs ``--quantize int8`` vs ``--quantize int4``, side by side.

Builds (or reuses) a random-weight Qwen3 shape of bench/serving.py (default ``qwen3-31m``: hidden
512, 8 layers, the built-in tokenizer), prints the probe set's mean per-token KL(f32 || int8/int4)
and the quantized weight bytes (in process, kiln.runtime.quantize), then runs the three servers
through bench/serving.py's interleaved A/B runner (``--rounds`` rounds, the order flipped every
round) at ``--concurrency`` (default 8) and prints tokens/s, CPU per token and the ratios to f32.

llama.cpp's server runs beside them as the peer (bench/peers/llamacpp.py: built from the
``llama-cpp-python`` sdist's source, the same model converted by its own converter and quantized
to Q8_0 / Q4_0; ``--peer-f32`` adds its f32 GGUF), 8 slots of the model's context, with
``--peer-threads`` threads (default 1): the ratios int8 / Q8_0 and int4 / Q4_0 are printed. Where
it cannot be built the run says why and goes on without it (``--no-llamacpp`` skips it).

Why one peer thread by default: llama.cpp's threads meet at a barrier after every op of the graph
(spinning while they wait), so on a CPU shared with other work one descheduled thread stalls the
whole step. On the 2-core shared machine with ``-t 2`` (load 8-10) its Q8_0 and Q4_0 servers both
fell to 20-22 tok/s, while ``-t 1`` in the same minutes gave Q8_0 501-523 and Q4_0 1,397-1,549
tok/s: the "Q8_0 49 tok/s" of earlier runs was this collapse, not the type. Kiln's decode matmuls
run on one thread (quant_matmul's OpenMP threshold), so ``--threads 1 --peer-threads 1`` gives
both one core; ``--peer-threads 2`` reproduces the earlier setting.

    .venv/bin/python bench/quantized.py                       # qwen3-31m, c=8, 1 round
    .venv/bin/python bench/quantized.py --rounds 2 --threads 1 --concurrency 1 8
    .venv/bin/python bench/quantized.py --no-llamacpp        # kiln only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("int8", "int4")
PEERS = {"int8": "Q8_0", "int4": "Q4_0"}  # kiln's mode -> the llama.cpp type it is compared with


def probe(model_dir: Path) -> dict[str, dict]:
    """The load-time report of each mode (KL, bytes) on this model, in process."""
    from kiln.runtime.loader import load_model
    from kiln.runtime.quantize import quantize_loaded

    out = {}
    for mode in MODES:
        loaded = load_model(model_dir, device="cpu")
        out[mode] = quantize_loaded(loaded, mode, None).as_dict()
    return out


def peer_arms(model_dir: Path, threads: int, with_f32: bool) -> list[tuple[str, list[str], dict]]:
    """llama.cpp's arms (label, command, environment), or none with the reason printed."""
    sys.path.insert(0, str(ROOT / "bench" / "peers"))
    from llamacpp import PeerUnavailable, convert, server_command, server_env
    from serving import model_max_len

    try:
        files = convert(model_dir)
    except PeerUnavailable as exc:
        print(f"llama.cpp peer skipped: {exc}")
        return []
    env = server_env()
    types = (["F32"] if with_f32 else []) + list(PEERS.values())
    return [(f"llamacpp-{t.lower()}", server_command(files[t], threads or 1, 8,
                                                     model_max_len(model_dir), model_dir.name), env) for t in types]


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
    ap.add_argument("--peer-threads", type=int, default=1, help="llama-server -t/-tb (see the docstring)")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer")
    ap.add_argument("--peer-f32", action="store_true", help="also llama.cpp over the f32 GGUF")
    args = ap.parse_args()

    model_dir = build_shape_model(args.shape, kiln_home())
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for mode, rep in probe(model_dir).items():
        print(f"{mode}: probe KL {rep['probe_kl']:.2e} nats/token over {rep['probe_tokens']} tokens, weights "
              f"{rep['weight_bytes_before'] / 2**20:.1f} -> {rep['weight_bytes_after'] / 2**20:.1f} MiB, "
              f"kernel {rep['kernel']}, layers {rep['layers']}")
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-quant-"))
    env, cmd = kiln_env(workdir), kiln_command(model_dir, args.threads)
    arms = [("f32", cmd, env)] + [(m, cmd + ["--quantize", m], env) for m in MODES]
    arms += [] if args.no_llamacpp else peer_arms(model_dir, args.peer_threads, args.peer_f32)
    texts_by_c = {c: prompts_for(max(8, args.waves * c)) for c in args.concurrency}
    runs = ab_runs(model_dir, workdir, arms, texts_by_c, args.max_tokens, args.rounds)
    print(f"{'base':<16}{'round':>6}{'c':>4}{'tok/s':>8}{'CPU ms/tok':>11}{'ITL p50':>9}  (ms)")
    for r in runs:
        print(f"{r['setting']:<16}{r['round']:>6}{r['concurrency']:>4}{r['tok_s']:>8.0f}{r['cpu_ms_per_tok']:>11.3f}"
              f"{r['itl_p50_ms']:>9.2f}")
    for c in args.concurrency:
        best = {label: max(r["tok_s"] for r in runs if r["setting"] == label and r["concurrency"] == c)
                for label, _, _ in arms}
        cpu = {label: min(r["cpu_ms_per_tok"] for r in runs if r["setting"] == label and r["concurrency"] == c)
               for label, _, _ in arms}
        print(f"c={c}: best tok/s " + ", ".join(f"{k} {v:.0f}" for k, v in best.items()) + "; vs f32: "
              + ", ".join(f"{m} {best[m] / best['f32']:.2f}x tok/s, {cpu['f32'] / cpu[m]:.2f}x CPU/tok" for m in MODES))
        peers = [(m, f"llamacpp-{PEERS[m].lower()}") for m in MODES if f"llamacpp-{PEERS[m].lower()}" in best]
        if peers:
            print(f"c={c}: vs llama.cpp: " + ", ".join(
                f"{m} / {p[9:]} {best[m] / best[p]:.2f}x tok/s, {cpu[p] / cpu[m]:.2f}x CPU/tok" for m, p in peers))

    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
