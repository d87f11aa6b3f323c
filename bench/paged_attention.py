"""In-place paged attention (kiln.runtime.paged_attention) next to the path it replaces.

Two parts, both with one torch thread (the engine's default):

* ``layer``: one layer's attention, the C kernel reading blocks in place against
  ``index_select`` of the rows' blocks + SDPA with a mask (the gather path), on random
  pools: decode tokens (1, 8, 32 rows at 128 and 512 positions) and one prompt chunk of
  256 tokens, for the 31M Qwen3 shape's heads (8 x 64, MHA) and Qwen3-0.6B's (16 over 8
  KV heads x 128). The pool is hot in cache here, so these are the kernel's arithmetic,
  not its memory traffic.
* ``step``: a whole decode step of the lean forward through ``Batches.decode`` on a real
  model (default: the 31M shape, built offline like bench/serving.py does), kernel on
  and off on the same pool, each best of 3 x 20 steps, with the logits' largest
  difference; the pool is cold here as in serving (all layers' KV between two reads).

    .venv/bin/python bench/paged_attention.py                 # both parts
    .venv/bin/python bench/paged_attention.py --part layer
    .venv/bin/python bench/paged_attention.py --part step --rows 1 8 32 --context 100
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent


def best_ms(fn, reps: int = 5, inner: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e3


def layer_part(kernel) -> None:
    import torch
    import torch.nn.functional as F

    print("one layer, hot pool: kernel vs gather + SDPA (ms)")
    print(f"{'case':44} {'kernel':>8} {'gather+sdpa':>12} {'ratio':>6} {'max diff':>9}")
    cases = [(rows, ctx, 8, 8, 64, "decode") for rows in (1, 8, 32) for ctx in (128, 512)]
    cases += [(rows, ctx, 16, 8, 128, "decode") for rows in (1, 8, 32) for ctx in (128, 512)]
    cases += [(1, 256, 8, 8, 64, "chunk"), (1, 256, 16, 8, 128, "chunk")]
    bs = 16
    for rows, ctx, heads, kvh, dim, kind in cases:
        gen = torch.Generator().manual_seed(0)
        width = -(-ctx // bs)
        blocks = rows * width + 1
        keys = torch.randn(blocks, bs, kvh, dim, generator=gen)
        values = torch.randn(blocks, bs, kvh, dim, generator=gen)
        table = (torch.randperm(blocks - 1, generator=gen) + 1).view(rows, width).contiguous()
        if kind == "decode":
            pos = torch.randint(ctx // 2, ctx, (rows,), generator=gen)
            row_of = torch.arange(rows)
        else:
            pos = torch.arange(ctx)
            row_of = torch.zeros(ctx, dtype=torch.long)
        tokens = len(pos)
        q = torch.randn(tokens, heads, dim, generator=gen)
        scale = 1 / math.sqrt(dim)
        kv_len = width * bs
        if kind == "decode":
            mask = (torch.arange(kv_len)[None] <= pos[:, None])[:, None, None, :]
            qs = q[:, :, None]  # [rows, heads, 1, dim]
        else:
            mask = (torch.arange(kv_len)[None] <= pos[:, None])[None, None]
            qs = q.transpose(0, 1)[None]  # [1, heads, tokens, dim]
        flat = table.reshape(-1)
        n = rows if kind == "decode" else 1

        def gathered():
            k = keys.index_select(0, flat).view(n, kv_len, kvh, dim).transpose(1, 2)
            v = values.index_select(0, flat).view(n, kv_len, kvh, dim).transpose(1, 2)
            return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kvh)

        def in_place():
            return kernel.attend(q, keys, values, table, row_of, pos, scale)

        ref = gathered()
        ref = ref[:, :, 0].reshape(tokens, -1) if kind == "decode" else ref[0].transpose(0, 1).reshape(tokens, -1)
        diff = (in_place() - ref).abs().max().item()
        a, b = best_ms(in_place), best_ms(gathered)
        name = f"{kind} rows={rows} ctx={ctx} heads={heads}/{kvh}x{dim}"
        print(f"{name:44} {a:8.3f} {b:12.3f} {b / a:5.2f}x {diff:9.1e}")


def step_part(kernel, model_dir: Path, rows_list: list[int], context: int) -> None:
    import torch

    from kiln.runtime.adapter_slots import BASE_KEY
    from kiln.runtime.batches import Batches
    from kiln.runtime.loader import load_model
    from kiln.runtime.paged_kv import BlockPool, cache_shape

    model = load_model(model_dir).model
    pool = BlockPool(cache_shape(model.config), 4096, 16, device="cpu", dtype=torch.float32)
    both = {on: Batches(pool, None, "cpu", 0, model=model, packed_weights=True, paged_attention=kernel if on else None)
            for on in (False, True)}
    print(f"\ndecode step, {model_dir.name}, cold pool, ~{context} positions per row (ms, best of 3 x 20)")
    print(f"{'rows':>5} {'gather+sdpa':>12} {'in place':>9} {'speed-up':>9} {'max logit diff':>15}")
    for n in rows_list:
        rows = []
        for i in range(n):
            length = context + i % 16
            blocks = [pool.allocate() for _ in range(pool.blocks_for(length + 1))]
            rows.append(SimpleNamespace(pos=length, blocks=blocks, generated=[5], adapter_key=BASE_KEY))
        with torch.inference_mode():
            for t in pool.keys + pool.values:
                t.normal_()

            def step(on: bool, rows=rows):
                for r in rows:
                    r.pos -= 1  # decode advances pos: keep every step at the same positions
                return both[on].decode(rows)

            times = {on: [] for on in both}
            for _ in range(3):
                for on in both:
                    times[on].append(best_ms(lambda on=on: step(on), reps=1, inner=20))
            diff = (step(True) - step(False)).abs().max().item()
        off, on = min(times[False]), min(times[True])
        print(f"{n:5d} {off:12.2f} {on:9.2f} {off / on:8.2f}x {diff:15.1e}")
        for r in rows:
            pool.release(r.blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["layer", "step", "both"], default="both")
    ap.add_argument("--model", help="model directory for the step part (default: the 31M Qwen3 shape)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=100, help="positions per row in the step part")
    args = ap.parse_args()

    import torch

    from kiln.runtime import paged_attention

    torch.set_num_threads(1)
    kernel = paged_attention.load()
    if kernel is None:
        sys.exit("the kernel could not be built here (see the warning above)")
    print(f"kernel: {kernel.path}")
    if args.part in ("layer", "both"):
        layer_part(kernel)
    if args.part in ("step", "both"):
        sys.path.insert(0, str(HERE))
        import serving  # bench/serving.py builds the shapes offline

        model_dir = serving.resolve_model(args.model, None if args.model else "qwen3-31m")
        step_part(kernel, Path(model_dir), args.rows, args.context)


if __name__ == "__main__":
    main()
