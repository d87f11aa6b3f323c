"""Qwen3.5 hybrids: Kiln's engine on the lean hybrid forward vs on transformers' forward vs HF static batching.

One process, same model (a ``bench/serving.py`` shape, random weights), same prompts, every system
generating exactly ``--max-tokens`` greedy tokens per prompt (EOS ignored):

* ``kiln-lean``: the engine (in process, ``--concurrency`` client threads) with the lean hybrid forward
  (kiln.runtime.lean_hybrid: packed variable-length cycles, the fused Gated DeltaNet decode step, the
  chunked prefill, in-place paged attention);
* ``kiln-hf``: the same engine with ``lean_forward = false`` (transformers' forward per cycle: the path
  hybrids ran on before);
* ``hf-static``: transformers ``generate`` on left-padded batches of ``--concurrency`` prompts.

Prints tokens/s of each and the ratios; arms alternate over ``--rounds`` (best of each reported).

    .venv/bin/python bench/hybrid.py --shape qwen3.5-hybrid-25m --concurrency 8 --prompts 16 --max-tokens 48
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SHAPES, build_shape_model, hf_runs, prompts_for  # noqa: E402


def engine_tok_s(model_dir: Path, texts: list[str], max_tokens: int, concurrency: int, lean: bool) -> dict:
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.runtime.sampling import SamplingParams

    engine = Engine(load_model(model_dir), EngineConfig(max_model_len=1024, lean_forward=lean)).start()
    try:
        assert (engine._scheduler.batches.hybrid is not None) == lean, "the lean hybrid forward did not engage"
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]
        engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
        queue = list(prompts)
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop()
                engine.generate(prompt, params)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
    finally:
        engine.stop()
    return {"system": "kiln-lean" if lean else "kiln-hf", "tok_s": len(texts) * max_tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-hybrid-25m", choices=[s for s in SHAPES if "3.5" in s])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' static batching")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for every system (0: as kiln serve picks)")
    args = ap.parse_args()
    import torch

    from kiln.runtime.threads import default_threads

    torch.set_num_threads(args.threads or default_threads())  # the same for the engine and for generate
    home = Path(os.environ.get("KILN_HOME", Path.home() / ".kiln"))
    model_dir = build_shape_model(args.shape, home)
    texts = prompts_for(args.prompts)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        runs = [engine_tok_s(model_dir, texts, args.max_tokens, args.concurrency, lean) for lean in (True, False)]
        if not args.no_hf:
            hf = hf_runs(model_dir, texts, args.max_tokens, [args.concurrency], 1, False)
            runs += [{"system": "hf-static", "tok_s": r["tok_s"]} for r in hf if r["system"].startswith("hf-static")]
        for r in runs:
            best[r["system"]] = max(best.get(r["system"], 0.0), r["tok_s"])
    load = os.getloadavg()[0]
    print(f"shape {args.shape}, c={args.concurrency}, {args.prompts} prompts x {args.max_tokens} tokens, "
          f"{torch.get_num_threads()} torch threads, load {load:.1f}")
    for name, tok_s in best.items():
        print(f"  {name:10s} {tok_s:8.1f} tok/s")
    lean = best["kiln-lean"]
    for name, tok_s in best.items():
        if name != "kiln-lean":
            print(f"  kiln-lean / {name}: {lean / tok_s:.2f}x")


if __name__ == "__main__":
    main()
