"""Kiln's own CPU int8/int4 weight-only matmul (``quant_matmul.c`` beside this file), one kernel
candidate of kiln.runtime.quantize's measured choice.

The C file quantizes the activations to int8 (one scale per :data:`INT8_GROUP` elements of a
row) and takes integer dot products with the weights, a group's accumulated in int32 (int4: each
block of 32 weighted by its integer sub-scale, :func:`int4_subscales`): AVX-512 VNNI (512- or
256-bit vectors), AVX2 + FMA or portable C, chosen from the running CPU; OpenMP splits the output features across ``threads``
for large matrices. It is built once through :func:`kiln.runtime.paged_attention.build` (the one
C builder, cached in :func:`kiln.runtime.paged_attention.kernel_dir`) and self-checked against
the dequantized reference before use: no compiler, a failed build or a failed check and
:func:`load` returns ``None`` with the reason logged once (the other candidates remain).

Weight layouts (see the C file): int8 ``qweight`` int8 ``[N, K]`` with ``scales`` float32 ``[N]``;
int4 ``qweight`` uint8 ``[N, K / 2]`` (:func:`pack_int4`) with ``scales`` float32
``[N, K / 32, 2]`` = (scale, zero), ``w = (q - 8) * scale + zero``, where each row's block scales are
integer multiples (1..255) of one row scale (:func:`snap_int4_scales`; the kernel takes the integers
and the row scale, :func:`int4_subscales`). Float32 only; K a multiple of 32.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from kiln.runtime.paged_attention import KernelUnavailable, build, kernel_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quant_matmul.c")
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")
LIBS = ("-lm", "-fopenmp")
BLOCK = 32
ISAS = {"portable": 0, "avx2": 1, "vnni": 2, "vnni512": 3}
INT8_GROUP = 256  # activation elements per scale, int8 and int4 (their block dots add up in int32; see the C file)
SUB_MAX = 255  # int4: a block scale is rowscale * (1..SUB_MAX)

_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class QmmArgs(ctypes.Structure):
    """``kiln_qmm_args`` in ``quant_matmul.c`` (same order and types)."""

    _fields_ = [("x", _PTR), ("m", _I64), ("k", _I64), ("w", _PTR), ("scales", _PTR), ("bias", _PTR),
                ("n", _I64), ("mode", _I32), ("threads", _I32), ("isa", _I32), ("out", _PTR),
                ("group", _I64), ("sub", _PTR), ("rowscale", _PTR)]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 ``[N, K]`` -> uint8 ``[N, K / 2]``: per block of 32, byte j = element j | element j + 16 << 4."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 codes ``[N, K]``."""
    n, half = packed.shape
    p = packed.reshape(n, half * 2 // BLOCK, BLOCK // 2)
    return torch.stack([p & 15, p >> 4], dim=2).reshape(n, half * 2)


def snap_int4_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales ``[N, B]`` (> 0) rounded up to integer multiples of ``max / SUB_MAX`` per row: the
    form the kernel's int32 accumulation takes (a block's step grows by at most the row's max / 255)."""
    row = (scale.amax(dim=-1, keepdim=True) / SUB_MAX).clamp(min=1e-30)
    return row * torch.ceil(scale / row * (1 - 1e-6)).clamp(1, SUB_MAX)


def int4_subscales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sub int16 [N, K / 32], rowscale float32 [N])`` of int4 ``scales [N, K / 32, 2]`` snapped by
    :func:`snap_int4_scales`: ``scale = rowscale * sub``."""
    s = scales[..., 0].float()
    row = (s.amax(dim=-1) / SUB_MAX).clamp(min=1e-30)
    sub = torch.round(s / row[:, None]).clamp(1, SUB_MAX).to(torch.int16).contiguous()
    return sub, row.contiguous()


class QuantMatmul:
    """The loaded library: :meth:`matmul`."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        self._fn = lib.kiln_qmm
        self._fn.argtypes = [ctypes.POINTER(QmmArgs)]
        self._fn.restype = ctypes.c_int
        isa = lib.kiln_qmm_isa
        isa.restype = ctypes.c_int
        self.isa = {v: k for k, v in ISAS.items()}[isa()]
        self.path = path

    def matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mode: str,
               bias: torch.Tensor | None = None, threads: int = 1, isa: str | None = None,
               group: int | None = None, sub: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [M, K] @ W.T (+ bias)`` -> ``[M, N]`` float32 (``isa``: force a path, tests only; ``group``:
        activation elements per scale, a multiple of 32, 0 = the whole row; default :data:`INT8_GROUP`;
        ``sub``: int4's :func:`int4_subscales` of ``scales``, computed here when not given)."""
        m, k = x.shape
        n = qweight.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or k % BLOCK:
            raise ValueError("quant matmul: contiguous float32 x [M, K] with K a multiple of 32")
        want = (n, k) if mode == "int8" else (n, k // 2)
        if tuple(qweight.shape) != want or not qweight.is_contiguous() or not scales.is_contiguous() \
                or scales.dtype != torch.float32:
            raise ValueError(f"quant matmul: {mode} weight must be {want}, contiguous, with float32 scales")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError("quant matmul: bias must be contiguous float32 [N]")
        if mode == "int4":
            sub = int4_subscales(scales) if sub is None else sub
            if sub[0].shape != (n, k // BLOCK) or sub[0].dtype != torch.int16 or sub[1].shape != (n,) \
                    or not (sub[0].is_contiguous() and sub[1].is_contiguous()):
                raise ValueError(f"quant matmul: int4 sub-scales must be contiguous int16 [{n}, {k // BLOCK}] and [{n}]")
        out = torch.empty(m, n, dtype=torch.float32)
        if m == 0:  # no rows (a step whose rows keep no logits): an empty x has no data pointer to pass
            return out
        args = QmmArgs(x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(),
                       None if bias is None else bias.data_ptr(), n, 8 if mode == "int8" else 4, threads,
                       -1 if isa is None else ISAS[isa], out.data_ptr(), INT8_GROUP if group is None else group,
                       None if sub is None else sub[0].data_ptr(), None if sub is None else sub[1].data_ptr())
        rc = self._fn(ctypes.byref(args))
        if rc != 0:
            raise MemoryError("quant matmul: out of memory") if rc == -1 else ValueError(
                f"quant matmul rejected its arguments (code {rc})")
        return out


def reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mode: str) -> torch.Tensor:
    """``x @ W.T`` with ``W`` dequantized from this module's layouts (float32; tests and the self-check)."""
    if mode == "int8":
        w = qweight.float() * scales[:, None]
    else:
        n, k = qweight.shape[0], qweight.shape[1] * 2
        codes = unpack_int4(qweight).float().reshape(n, k // BLOCK, BLOCK)
        w = ((codes - 8.0) * scales[..., 0:1] + scales[..., 1:2]).reshape(n, k)
    return x @ w.T


def self_check(kernel: QuantMatmul, isa: str | None = None) -> None:
    """Both modes on a small random matrix against :func:`reference`; :class:`KernelUnavailable` if off."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g)
    q8 = torch.randint(-127, 128, (24, 96), generator=g, dtype=torch.int8)
    s8 = torch.rand(24, generator=g) * 0.01 + 1e-3
    q4 = pack_int4(torch.randint(0, 16, (24, 96), generator=g))
    s4 = torch.stack([snap_int4_scales(torch.rand(24, 3, generator=g) * 0.05 + 1e-3),
                      torch.randn(24, 3, generator=g) * 0.01], -1)
    for mode, q, s in (("int8", q8, s8), ("int4", q4, s4.contiguous())):
        want = reference(x, q, s, mode)
        got = kernel.matmul(x, q, s, mode, threads=2, isa=isa)
        err = float((got - want).abs().max() / want.abs().max())
        if err > 2e-2:  # the activations' int8 rounding: about 0.4 % of a block's largest value
            raise KernelUnavailable(f"quant matmul self-check failed ({mode}): relative error {err:.3g}")


_loaded: list[QuantMatmul | None] = []
_lock = threading.Lock()


def load() -> QuantMatmul | None:
    """The kernel, built (or found) and self-checked once per process, or ``None`` (reason logged once)."""
    if _loaded:  # every call of a c layer asks: no lock once decided
        return _loaded[0]
    with _lock:
        if not _loaded:
            try:
                kernel: QuantMatmul | None = QuantMatmul(build(kernel_dir(), source=SOURCE, flags=FLAGS, libs=LIBS))
                assert kernel is not None
                self_check(kernel)
            except (KernelUnavailable, OSError) as exc:
                log.warning("quant matmul kernel unavailable (%s); int8/int4 use torch's kernels", exc)
                kernel = None
            _loaded.append(kernel)
        return _loaded[0]
