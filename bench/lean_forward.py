"""One decode forward of the engine's lean forward against transformers' module forward.

Builds (or reuses) the random-weight Qwen3 31M shape of bench/serving.py and times one
decode step (one new token per row, ``--cached`` positions already in a real paged KV
pool, block size 16) at several row counts, on one torch thread, for:

* ``module``   - transformers' forward (what the engine runs for rows with an adapter);
* ``lean``     - kiln.runtime.lean_forward without packed weights (bitwise the module's logits);
* ``before``   - the packed lean forward as of git revision ``--before`` (loaded from git);
* ``packed``   - the packed lean forward of this tree with ``fuse=False`` (separate q/k/v, gate/up);
* ``fused``    - the packed lean forward of this tree (fused q|k|v and gate|up weights).

Each figure is the best (min) over ``--repeats`` rounds of the mean of ``--iters`` steps;
the variants run interleaved, in a rotated order, in every round so load on a shared machine
hits all of them.
Also prints each variant's max abs logit difference from the module forward.

    .venv/bin/python bench/lean_forward.py [--rows 1,8,32] [--cached 80] [--before ace0567] [--mallopt]

At 32 rows the step's large temporaries (the KV gather's ``index_select`` output, about
6 MiB per layer for keys and as much for values) can page-fault on every allocation,
depending on glibc's dynamic mmap/trim thresholds: ``--mallopt`` fixes those thresholds
high so the comparison is not decided by allocator state.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_revision(rev: str):
    """kiln.runtime.lean_forward as of git revision ``rev`` (a module loaded from a temp file), or None."""
    try:
        src = subprocess.run(["git", "show", f"{rev}:src/kiln/runtime/lean_forward.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"before: cannot read revision {rev}: {exc}", file=sys.stderr)
        return None
    path = Path(tempfile.mkdtemp()) / "lean_forward_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("lean_forward_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-31m")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--cached", type=int, default=80, help="positions already in the cache of every row")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--before", default="ace0567", help="git revision whose packed lean forward is 'before'")
    ap.add_argument("--mallopt", action="store_true",
                    help="raise glibc's mmap and trim thresholds first (large temporaries stop page-faulting)")
    args = ap.parse_args()
    if args.mallopt:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        # M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3 (malloc.h); setting them also stops their dynamic adjustment
        ok = libc.mallopt(-3, 256 << 20) and libc.mallopt(-1, 512 << 20)
        print(f"mallopt: mmap threshold 256 MiB, trim threshold 512 MiB ({'ok' if ok else 'refused'})")

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from serving import build_shape_model

    from kiln.config import kiln_home
    from kiln.runtime.lean_forward import LeanForward
    from kiln.runtime.paged_kv import BlockPool, cache_shape

    torch.set_num_threads(1)
    path = build_shape_model(args.shape, kiln_home())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = model.config

    def module_forward(ids, pos, mask, cache, keep):
        return model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                     logits_to_keep=keep).logits

    variants = {"module": module_forward, "lean": LeanForward(model, pack=False)}
    old = load_revision(args.before)
    if old is not None:
        variants["before"] = old.LeanForward(model, pack=True)
    variants["packed"] = LeanForward(model, pack=True, fuse=False)
    variants["fused"] = LeanForward(model, pack=True)

    rows_list = [int(r) for r in args.rows.split(",")]
    bs = 16
    per_row = (args.cached + 1 + bs - 1) // bs
    pool = BlockPool(cache_shape(cfg), max(rows_list) * per_row + 2, bs, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    print(f"shape {args.shape}, {args.cached} cached positions, 1 torch thread, "
          f"best of {args.repeats} x {args.iters} steps (ms per step)")
    header = f"{'rows':>4} " + " ".join(f"{k:>8}" for k in variants) + "   ratios"
    print(header)
    with torch.inference_mode():
        for t in pool.keys + pool.values:
            t.normal_()
        for n in rows_list:
            tables = [[pool.allocate() for _ in range(per_row)] for _ in range(n)]
            table = pool.table(tables)
            pos = torch.full((n, 1), args.cached)
            wb, wo = table[torch.arange(n)[:, None], pos // bs], pos % bs
            mask = (torch.arange(table.shape[1] * bs)[None, None, :] <= pos[:, :, None])[:, None]
            ids = torch.randint(0, cfg.vocab_size, (n, 1))
            ref = module_forward(ids, pos, mask, pool.step(table, wb, wo), 1)
            diffs = {k: (f(ids, pos, mask, pool.step(table, wb, wo), 1) - ref).abs().max().item()
                     for k, f in variants.items()}
            best = {k: float("inf") for k in variants}
            names = list(variants)
            for r in range(args.repeats):
                for k in names[r % len(names):] + names[: r % len(names)]:  # a different order each round
                    f = variants[k]
                    f(ids, pos, mask, pool.step(table, wb, wo), 1)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        f(ids, pos, mask, pool.step(table, wb, wo), 1)
                    best[k] = min(best[k], (time.perf_counter() - t0) / args.iters * 1e3)
            ratios = []
            if "before" in best:
                ratios.append(f"before/fused {best['before'] / best['fused']:.2f}x")
            ratios.append(f"packed/fused {best['packed'] / best['fused']:.2f}x")
            ratios.append(f"module/fused {best['module'] / best['fused']:.2f}x")
            print(f"{n:>4} " + " ".join(f"{best[k]:8.3f}" for k in variants) + "   " + ", ".join(ratios))
            print("     max |logit - module|: " + ", ".join(f"{k} {d:.2e}" for k, d in diffs.items()))
            for blocks in tables:
                pool.release(blocks)


if __name__ == "__main__":
    main()
