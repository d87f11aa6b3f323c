"""Micro-benchmark of Kiln's C int8/int4 matmul (kiln.runtime.quant_matmul) on qwen3-31m's decode shapes.

8 rows, one thread, wall time per call (median of ``--calls`` after a warm-up), per shape and summed
over a qwen3-31m step (8 layers of q, k, v, o, gate, up, down + the 8,192 x 512 head), beside
``F.linear`` in float32; G multiply-adds/s = rows * N * K / time. ``--fused`` also times q|k|v and
gate|up as one call each (one activation rounding). Example::

    PYTHONPATH=src python bench/quant_kernel.py --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kiln.runtime import quant_matmul as qm
from kiln.runtime.quantize import _quant_int4, _quant_int8

SHAPES = {"q/k/v/o": (512, 512, 4), "gate/up": (1536, 512, 2), "down": (512, 1536, 1), "head": (8192, 512, 0)}
FUSED = {"qkv": (1536, 512, 1), "gate|up": (3072, 512, 1)}
LAYERS = 8


def _time(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _row(kern: qm.QuantMatmul, n: int, k: int, rows: int, calls: int, group: int | None) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g) * 0.02, torch.randn(rows, k, generator=g)
    q8, s8 = _quant_int8(w)
    codes, sz = _quant_int4(w, 32)
    q4, s4 = qm.pack_int4(codes), sz.transpose(0, 1).contiguous()
    sub = qm.int4_subscales(s4)
    return {"f32": _time(lambda: F.linear(x, w), calls),
            "int8": _time(lambda: kern.matmul(x, q8, s8, "int8", group=group), calls),
            "int4": _time(lambda: kern.matmul(x, q4, s4, "int4", group=group, sub=sub), calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--group", type=int, default=None, help="activation elements per scale, int8 and int4 (0: the row)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kern = qm.load()
    assert kern is not None, "the C kernel did not load"
    print(f"isa {kern.isa}, activation group {args.group or qm.INT8_GROUP if args.group is None else args.group}, rows {args.rows}, 1 thread (ms per call; G MAC/s)")
    step = {"f32": 0.0, "int8": 0.0, "int4": 0.0}
    for table in (SHAPES, FUSED):
        for name, (n, k, per_layer) in table.items():
            r = _row(kern, n, k, args.rows, args.calls, args.group)
            mac = args.rows * n * k / 1e9
            print(f"{name:8s} {n:5d}x{k:<5d} " + "  ".join(f"{m} {t:.3f} ({mac / t * 1e3:.0f})" for m, t in r.items()))
            if table is SHAPES:
                for m, t in r.items():
                    step[m] += t * (per_layer * LAYERS if per_layer else 1)
    print("qwen3-31m step (8 layers + head, unfused): " + "  ".join(f"{m} {t:.2f} ms" for m, t in step.items()))


if __name__ == "__main__":
    main()
