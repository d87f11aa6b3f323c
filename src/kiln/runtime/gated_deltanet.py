"""Gated DeltaNet (Qwen3.5's linear attention) for the lean hybrid forward: a fused C decode step,
the chunked (WY) prefill, and the torch reference both are checked against.

Decode (one token per row): :class:`GdnDecode` runs ``gated_deltanet.c`` (beside this file), one call
per layer over all decoding rows: the conv-window shift, the depthwise convolution and SiLU, the
q/k L2 norms, the gated delta-rule update of each value head's ``[k_dim, v_dim]`` matrix and the
output's gated RMSNorm, reading and writing each row's state in place in the
:class:`~kiln.runtime.linear_state.LinearStatePool` (no gather or scatter). It is built by
:func:`kiln.runtime.paged_attention.build` (the one builder of Kiln's C kernels) and checked once per
process against :func:`decode_reference` on a small random layer; no compiler, a failed build or a
failed check: :func:`load` logs why once and returns ``None``, and the lean hybrid forward runs
:func:`decode_reference` (plain torch, batched over rows) instead.

Prefill (a chunk of prompt tokens of one row): :func:`chunked` is the chunked form of the delta rule
(the WY representation: within a block of ``CHUNK`` tokens the per-token rank-1 updates become one
unit-lower-triangular solve and a few matmuls; blocks follow one another), so a prompt costs
``tokens / CHUNK`` sequential steps, not ``tokens``. It starts from the row's stored state, so a
prompt split into chunks over several engine cycles ends in the same state (to float rounding) as one
pass (a test checks both against the per-token recurrence).

The math is transformers' ``Qwen3_5GatedDeltaNet`` (its torch path): decay ``exp(-exp(A_log) *
softplus(a + dt_bias))``, ``beta = sigmoid(b)``, ``S = decay * S``, ``delta = (v - S^T k) * beta``,
``S += k delta^T``, ``o = S^T q`` with q and k L2-normalised (eps 1e-6) and q scaled by
``k_dim^-1/2``, then ``rmsnorm(o) * weight * silu(z)``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.runtime import paged_attention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gated_deltanet.c")
CHUNK = 64  # tokens per block of the chunked prefill (transformers' and FLA's default)
L2_EPS = 1e-6


@dataclass(frozen=True)
class GdnLayer:
    """One Gated DeltaNet layer's constants (views of the module's parameters)."""

    conv_w: torch.Tensor  # [conv_dim, kernel], contiguous
    a_log: torch.Tensor  # [v_heads]
    dt_bias: torch.Tensor  # [v_heads]
    norm_w: torch.Tensor  # [v_dim]
    eps: float
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def of(cls, gdn: Any) -> "GdnLayer":
        return cls(gdn.conv1d.weight.detach().squeeze(1), gdn.A_log.detach(), gdn.dt_bias.detach(),
                   gdn.norm.weight.detach(), float(gdn.norm.variance_epsilon), gdn.num_k_heads, gdn.num_v_heads,
                   gdn.head_k_dim, gdn.head_v_dim)

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim


def gates(a: torch.Tensor, b: torch.Tensor, layer: GdnLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(log decay ``g``, ``beta``) from the in_proj_a / in_proj_b outputs ``[..., v_heads]``."""
    g = -layer.a_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    return g, b.sigmoid()


def heads(y: torch.Tensor, layer: GdnLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k ``[tokens, v_heads, k_dim]`` (normalised, q scaled, key heads repeated per value head) and
    v ``[tokens, v_heads, v_dim]`` from the convolution output ``y`` ``[tokens, conv_dim]``."""
    t, kd = y.shape[0], layer.key_dim
    q = y[:, :kd].reshape(t, layer.k_heads, layer.k_dim).float()
    k = y[:, kd:2 * kd].reshape(t, layer.k_heads, layer.k_dim).float()
    v = y[:, 2 * kd:].reshape(t, layer.v_heads, layer.v_dim).float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * layer.k_dim ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    group = layer.v_heads // layer.k_heads
    if group > 1:
        q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    return q, k, v


def gated_norm(o: torch.Tensor, z: torch.Tensor, layer: GdnLayer) -> torch.Tensor:
    """``rmsnorm(o) * weight * silu(z)`` per value head: ``o`` ``[tokens, v_heads, v_dim]`` ->
    ``[tokens, v_heads * v_dim]``."""
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps)
    out = layer.norm_w * o * F.silu(z.reshape(o.shape).float())
    return out.reshape(o.shape[0], -1)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None, chunk: int = CHUNK,
            marks: dict[int, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over one row's tokens in blocks of ``chunk`` (WY form) -> (o ``[t, heads, v_dim]``,
    final state ``[heads, k_dim, v_dim]``). ``q``/``k`` ``[t, heads, k_dim]`` as :func:`heads` gives them,
    ``v`` ``[t, heads, v_dim]``, ``g``/``beta`` ``[t, heads]``, ``state`` the state before the first token
    (``None``: an empty one; the first block then skips its terms). ``marks``: token counts (1..t) after
    which a copy of the state is put in (``marks[end]``); a block also ends at each mark, so the copies
    equal the final states of separate passes split there.

    Within a block (positions 1..L, G the running sum of g): the pseudo-values U solve
    ``(I + A) U = beta*V - diag(beta * e^G) K S0`` with ``A[t, j] = beta_t e^(G_t - G_j) k_t.k_j`` (j < t);
    then ``O = (Q e^G) S0 + (Q K^T o D) U`` with ``D[t, j] = e^(G_t - G_j)`` (j <= t), and the block ends
    in ``S = e^(G_L) S0 + (K e^(G_L - G))^T U``."""
    outs = []
    s = None if state is None else state.float()
    t = q.shape[0]
    stops = sorted(e for e in (marks or ()) if 0 < e < t)
    at = 0
    while at < t:
        end = min(at + chunk, t)
        while stops and stops[0] <= at:
            stops.pop(0)
        if stops and stops[0] < end:
            end = stops[0]
        qc, kc, vc = (x[at:end].transpose(0, 1) for x in (q, k, v))  # [heads, L, dim]
        gc, bc = g[at:end].t(), beta[at:end].t().float()  # [heads, L]
        cum = gc.cumsum(-1)
        # D: exp then tril (above the diagonal G_t - G_j > 0 may overflow to inf; tril writes zeros there)
        decay = (cum[:, :, None] - cum[:, None, :]).exp().tril()
        kt = kc.transpose(-1, -2)
        # solve_triangular reads only the strict lower triangle of a unit-triangular system: no tril, no diagonal
        system = kc @ kt * decay * bc[:, :, None]
        last = cum[:, -1:]
        if s is None:
            u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
            o = (qc @ kt * decay) @ u
            s = (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
        else:
            rhs = torch.cat([vc * bc[..., None], kc * (bc * cum.exp())[..., None]], -1)
            sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
            u = sol[..., :vc.shape[-1]] - sol[..., vc.shape[-1]:] @ s
            o = (qc * cum.exp()[..., None]) @ s + (qc @ kt * decay) @ u
            s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
        outs.append(o.transpose(0, 1))
        at = end
        if marks is not None and end in marks:
            marks[end] = s.clone()
    assert s is not None
    return (torch.cat(outs) if len(outs) > 1 else outs[0]), s


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> torch.Tensor:
    """One delta-rule step for a batch of rows, updating ``state`` ``[rows, heads, k_dim, v_dim]`` in
    place; ``q``/``k`` ``[rows, heads, k_dim]``, ``v`` ``[rows, heads, v_dim]``, ``g``/``beta``
    ``[rows, heads]`` -> o ``[rows, heads, v_dim]``. Applied token by token it is the reference of
    :func:`chunked`."""
    state.mul_(g.exp()[..., None, None])
    delta = (v - torch.einsum("rhkv,rhk->rhv", state, k)) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return torch.einsum("rhkv,rhk->rhv", state, q)


def decode_reference(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, layer: GdnLayer) -> torch.Tensor:
    """The decode step of :class:`GdnDecode` in torch (rows batched): ``mixed`` ``[rows, conv_dim]``,
    ``a``/``b`` ``[rows, v_heads]``, ``z`` ``[rows, v_heads * v_dim]``; ``conv``/``state`` the pool's
    tensors, row r at slot ``slots[r]`` (updated) -> ``[rows, v_heads * v_dim]``."""
    window = torch.cat([conv.index_select(0, slots)[..., 1:], mixed[..., None].to(conv.dtype)], -1)
    conv.index_copy_(0, slots, window)
    y = F.silu((window * layer.conv_w).sum(-1))
    q, k, v = heads(y, layer)
    g, beta = gates(a, b, layer)
    s = state.index_select(0, slots)
    o = recurrent(q, k, v, g, beta, s)
    state.index_copy_(0, slots, s)
    return gated_norm(o, z, layer)


_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class GdnArgs(ctypes.Structure):
    """``kiln_gdn_args`` in ``gated_deltanet.c`` (same order and types)."""

    _fields_ = [("mixed", _PTR), ("a", _PTR), ("b", _PTR), ("z", _PTR), ("conv", _PTR), ("state", _PTR),
                ("slots", _PTR), ("conv_w", _PTR), ("a_log", _PTR), ("dt_bias", _PTR), ("norm_w", _PTR),
                ("eps", _F32), ("rows", _I64), ("conv_dim", _I64), ("kernel", _I64), ("k_heads", _I64),
                ("v_heads", _I64), ("k_dim", _I64), ("v_dim", _I64), ("out", _PTR)]


class GdnDecode:
    """The loaded C decode step: ``decode(...)`` with :func:`decode_reference`'s arguments."""

    def __init__(self, path: Path):
        fn = ctypes.CDLL(str(path)).kiln_gdn_decode
        fn.argtypes = [ctypes.POINTER(GdnArgs)]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.path = path

    def decode(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, layer: GdnLayer) -> torch.Tensor:
        rows = mixed.shape[0]
        mixed, a, b, z = (t.contiguous() for t in (mixed, a, b, z))
        consts = (layer.conv_w, layer.a_log, layer.dt_bias, layer.norm_w)
        tensors = (mixed, a, b, z, conv, state) + consts
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise ValueError("gated deltanet decode: contiguous float32 CPU tensors only")
        if slots.dtype != torch.int64 or slots.shape != (rows,) or conv.shape[1:] != layer.conv_w.shape \
                or state.shape[1:] != (layer.v_heads, layer.k_dim, layer.v_dim):
            raise ValueError("gated deltanet decode: int64 slots [rows] and pool tensors shaped for the layer")
        slots = slots.contiguous()
        out = torch.empty(rows, layer.v_heads * layer.v_dim, dtype=torch.float32)
        args = GdnArgs(*(t.data_ptr() for t in (mixed, a, b, z, conv, state, slots) + consts), layer.eps, rows,
                       layer.conv_w.shape[0], layer.conv_w.shape[1], layer.k_heads, layer.v_heads, layer.k_dim,
                       layer.v_dim, out.data_ptr())
        rc = self._fn(ctypes.byref(args))
        if rc != 0:
            raise MemoryError("gated deltanet kernel: out of memory") if rc == -1 else ValueError(
                f"gated deltanet kernel rejected its shapes (code {rc})")
        return out


def random_layer(gen: torch.Generator, *, k_heads: int = 2, v_heads: int = 4, k_dim: int = 8, v_dim: int = 8,
                 kernel: int = 4) -> GdnLayer:
    """A random layer's constants (the self-check and the tests)."""
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return GdnLayer(torch.randn(conv_dim, kernel, generator=gen) * 0.5, torch.rand(v_heads, generator=gen).log(),
                    torch.randn(v_heads, generator=gen), torch.randn(v_dim, generator=gen), 1e-6, k_heads, v_heads,
                    k_dim, v_dim)


def _self_check(kernel: GdnDecode) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = random_layer(gen)
    rows, slots_n = 3, 5
    conv = torch.randn(slots_n, layer.conv_w.shape[0], layer.conv_w.shape[1], generator=gen)
    state = torch.randn(slots_n, layer.v_heads, layer.k_dim, layer.v_dim, generator=gen)
    slots = torch.tensor([4, 0, 2])
    mixed = torch.randn(rows, layer.conv_w.shape[0], generator=gen)
    a, b = torch.randn(rows, layer.v_heads, generator=gen), torch.randn(rows, layer.v_heads, generator=gen)
    z = torch.randn(rows, layer.v_heads * layer.v_dim, generator=gen)
    conv2, state2 = conv.clone(), state.clone()
    got = kernel.decode(mixed, a, b, z, conv, state, slots, layer)
    want = decode_reference(mixed, a, b, z, conv2, state2, slots, layer)
    for name, x, y in (("output", got, want), ("conv state", conv, conv2), ("recurrent state", state, state2)):
        if not torch.allclose(x, y, atol=1e-5, rtol=1e-4):
            raise paged_attention.KernelUnavailable(
                f"self-check failed on the {name}: max difference {(x - y).abs().max().item():.3g}")


_loaded: list[GdnDecode | None] = []
_lock = threading.Lock()


def build(*, baseline_only: bool = False) -> Path:
    """The compiled library under :func:`kiln.runtime.paged_attention.kernel_dir` (built if missing)."""
    return paged_attention.build(paged_attention.kernel_dir(), baseline_only=baseline_only, source=SOURCE)


def load() -> GdnDecode | None:
    """The C decode step, built and self-checked once per process, or ``None`` (reason logged once)."""
    with _lock:
        if not _loaded:
            try:
                kernel: GdnDecode | None = GdnDecode(build())
                _self_check(kernel)  # type: ignore[arg-type]
            except (paged_attention.KernelUnavailable, OSError) as exc:
                log.warning("gated deltanet kernel unavailable (%s); decode steps run the torch reference", exc)
                kernel = None
            _loaded.append(kernel)
        return _loaded[0]
