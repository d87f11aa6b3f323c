"""A lean forward for the Qwen3.5 hybrids (Gated DeltaNet + gated full attention): the lean attention
path's speed-ups (kiln.runtime.lean_forward) on the hybrid layer stack.

Every forward is ONE packed sequence of variable-length rows (no padding): decode tokens and prompt
chunks of any rows side by side, ``[tokens, hidden]``, each token tagged with its row and position
(:class:`HybridBatch`). Per layer:

* full attention (Qwen3.5's: q_proj yields each head's query and an output gate; q/k RMSNorms with
  ``1 + weight``; RoPE on the first ``partial_rotary_factor`` of each head): projections in torch,
  then the in-place paged attention kernel (kiln.runtime.paged_attention) stores the keys and values
  in their blocks and attends over each token's own row (norm and RoPE are applied here, not in the
  kernel: partial rotary); without the kernel, each row gathers its blocks for SDPA;
* Gated DeltaNet: the rows decoding one token run the fused decode step (kiln.runtime.gated_deltanet:
  one C call per layer over all of them, state read and written in place in the linear-state pool;
  its torch reference when the kernel is unavailable); the prompt chunks of the cycle run their
  per-token parts (the convolution over each row's stored window, SiLU, q/k norms, gates, the gated
  output norm) once over all their tokens packed together, and the chunked (WY) delta rule per row
  from its stored state (fresh rows: zero window, empty state), so a prompt split over cycles gives
  the same state as one pass; with the prefix cache (``HybridBatch.snap_every``) a WY block also ends
  at every multiple of it inside the chunk and the state there is copied out
  (kiln.runtime.linear_state.LinearSnapshots). ``batched_prompts=False`` runs the reference instead:
  each chunk alone, in separate passes split at those multiples (the tests hold both equal);
* the MLP with gate|up fused.

Packed weights (``pack=True``) and LoRA rows come from :class:`~kiln.runtime.lean_forward.LeanForward`
(this class extends it): q|k|v, gate|up and the DeltaNet's qkv|z|b|a projections are packed as one
oneDNN weight each; adapters add their deltas per group of tokens with the same adapter, the DeltaNet
projections included (kiln.runtime.lean_lora). The state layout is the pool's (the same tensors
transformers' path reads through :class:`~kiln.runtime.linear_state.LinearStepState`), so rows can
move between this forward and transformers' (scoring rows, unsupported adapters).

Logits match transformers' forward to float rounding, not bitwise (F.rms_norm, the chunk boundaries
of the WY form, the C kernel's summation order); greedy outputs are checked equal in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from kiln.runtime import gated_deltanet as gdn
from kiln.runtime.adapter_slots import BASE_KEY
from kiln.runtime.lean_forward import LeanForward
from kiln.runtime.lean_lora import groups_for
from kiln.runtime.linear_state import LinearStatePool
from kiln.runtime.paged_kv import BlockPool
from kiln.runtime.threads import one_torch_thread

SUPPORTED = {"Qwen3_5ForCausalLM"}


@dataclass(frozen=True)
class HybridBatch:
    """One packed forward: ``ids``/``row_of``/``pos_of`` ``[tokens]``; row r's tokens are
    ``spans[r] = (first token, count)``, its linear state lives in slot ``slots[r]`` and starts empty
    when ``fresh[r]``; ``table`` ``[rows, width]`` its KV blocks; ``keep``: the tokens whose logits are
    returned; ``keys``: each row's adapter key (``None``: no adapter on any row). ``snap_every`` > 0:
    each prompt chunk's linear state is captured at every position within it (its end included) that
    is a multiple of ``snap_every``, into ``captured[row][position]`` (per linear layer, in layer
    order: a copy of the conv window and of the recurrent state), for the hybrid prefix cache."""

    ids: torch.Tensor
    row_of: torch.Tensor
    pos_of: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    slots: tuple[int, ...]
    fresh: tuple[bool, ...]
    table: torch.Tensor
    keep: torch.Tensor
    keys: tuple[str, ...] | None = None
    snap_every: int = 0
    captured: dict[int, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=dict)

    def steps(self) -> list[int]:
        """The rows that decode one token from a stored state (the fused step's rows)."""
        return [r for r, (_, n) in enumerate(self.spans) if n == 1 and not self.fresh[r]]


def _shifted_norm(h: torch.Tensor, norm: Any, cache: dict[int, tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Qwen3.5's RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + weight)``), its ``1 + weight`` kept per weight."""
    w = norm._parameters["weight"]
    hit = cache.get(w.data_ptr())
    if hit is None or hit[0] != w._version:
        hit = cache[w.data_ptr()] = (w._version, (1.0 + w.float()).to(w.dtype))
    return F.rms_norm(h, (h.shape[-1],), hit[1], norm.eps)


class LeanHybrid(LeanForward):
    """``logits = lean(batch, kv, states)`` for one Qwen3.5 hybrid (module docstring)."""

    def __init__(self, model: Any, *, pack: bool = False, kernel: Any = None, gdn_kernel: Any = None,
                 batched_prompts: bool = True):
        self._ones: dict[int, tuple[int, torch.Tensor]] = {}
        self.batched_prompts = batched_prompts  # False: the per-row reference prompt path (_delta_chunk)
        cfg = model.config
        self.rotary_dim = int((getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
                              * (cfg.rope_parameters or {}).get("partial_rotary_factor", 1.0))
        self.kernel = kernel  # in-place paged attention (None: gather + SDPA per row)
        self.gdn_kernel = gdn_kernel  # the fused decode step (None: its torch reference)
        self.gdn_layers = {i: gdn.GdnLayer.of(layer.linear_attn) for i, layer in enumerate(model.model.layers)
                           if hasattr(layer, "linear_attn")}
        super().__init__(model, pack=pack, fuse=True)

    def _fuse(self, layer: Any) -> None:
        mixer = layer._modules.get("linear_attn")
        if mixer is not None:
            self._fuse_group((mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a))
        else:
            attn = layer.self_attn
            self._fuse_group((attn.q_proj, attn.k_proj, attn.v_proj))
        self._fuse_group((layer.mlp.gate_proj, layer.mlp.up_proj))

    def forward_batch(self, batch: HybridBatch, kv: BlockPool, states: LinearStatePool) -> torch.Tensor:
        """Logits ``[len(batch.keep), vocab]``."""
        if batch.keys:
            token_keys = [batch.keys[r] for r, (_, n) in enumerate(batch.spans) for _ in range(n)]
            self._groups = groups_for(token_keys, batch.ids.device)
        try:
            return self._run(batch, kv, states)
        finally:
            self._groups = []

    def _run(self, batch: HybridBatch, kv: BlockPool, states: LinearStatePool) -> torch.Tensor:
        lm = self.model
        inner = lm.model
        h = getattr(inner.embed_tokens, "base_layer", inner.embed_tokens)(batch.ids)  # [tokens, hidden]
        cos, sin = inner.rotary_emb(h[None], batch.pos_of[None])
        rope = (cos[0], sin[0])
        cache = kv.step(batch.table, None, None, packed=True,
                        in_place=(self.kernel, batch.row_of, batch.pos_of)) if self.kernel is not None else None
        steps = batch.steps()
        for i, layer in enumerate(inner.layers):
            sub = layer._modules
            x = _shifted_norm(h, sub["input_layernorm"], self._ones)
            if i in self.gdn_layers:
                h = h + self._linear(self._delta_net(x, sub["linear_attn"]._modules, i, batch, states, steps),
                                     sub["linear_attn"]._modules["out_proj"])
            else:
                h = h + self._attention_block(x, sub["self_attn"]._modules, i, batch, kv, cache, rope)
            x = _shifted_norm(h, sub["post_attention_layernorm"], self._ones)
            h = h + self._mlp(x, sub["mlp"]._modules)
        h = _shifted_norm(h.index_select(0, batch.keep), inner.norm, self._ones)
        return self._head(h, lm.lm_head)  # no LoRA on the LM head here (LoraSupport refuses it)

    def _mlp(self, x: torch.Tensor, mlp: dict[str, Any]) -> torch.Tensor:
        gu = self._fused_linear(x, (mlp["gate_proj"], mlp["up_proj"])) if self.fused else None
        if gu is not None:
            g, u = gu.chunk(2, dim=-1)
            return self._linear(F.silu(g).mul_(u), mlp["down_proj"])
        lin = self._linear
        return lin(F.silu(lin(x, mlp["gate_proj"])) * lin(x, mlp["up_proj"]), mlp["down_proj"])

    def _projections(self, x: torch.Tensor, mods: tuple[Any, ...]) -> list[torch.Tensor]:
        """``x`` through each of ``mods`` (one fused matmul when they were packed together)."""
        joint = self._fused_linear(x, mods) if self.fused else None
        if joint is None:
            return [self._linear(x, m) for m in mods]
        widths = [m._modules.get("base_layer", m).out_features for m in mods]
        return list(joint.split(widths, dim=-1))

    # -- Gated DeltaNet ---------------------------------------------------------------------------
    def _delta_net(self, x: torch.Tensor, mods: dict[str, Any], i: int, batch: HybridBatch,
                   states: LinearStatePool, steps: list[int]) -> torch.Tensor:
        """The layer's gated, normalised output ``[tokens, v_heads * v_dim]`` (out_proj's input); the rows'
        conv windows and recurrent states are updated in the pool."""
        layer = self.gdn_layers[i]
        mixed, z, b, a = self._projections(x, (mods["in_proj_qkv"], mods["in_proj_z"], mods["in_proj_b"],
                                               mods["in_proj_a"]))
        at = states.index(i)
        conv, state = states.conv[at], states.recurrent[at]
        out = x.new_empty(x.shape[0], layer.v_heads * layer.v_dim)
        if steps:
            every = len(steps) == len(batch.spans)
            slots = torch.tensor([batch.slots[r] for r in steps], dtype=torch.long, device=x.device)
            tok = None if every else torch.tensor([batch.spans[r][0] for r in steps], device=x.device)
            parts = [t if tok is None else t.index_select(0, tok) for t in (mixed, a, b, z)]
            step: Callable[..., torch.Tensor] = (self.gdn_kernel.decode if self.gdn_kernel is not None
                                                 else gdn.decode_reference)
            o = step(*parts, conv, state, slots, layer)
            if tok is None:
                out = o
            else:
                out.index_copy_(0, tok, o)
        stepped = set(steps)
        prompts = [r for r in range(len(batch.spans)) if r not in stepped]
        if prompts and self.batched_prompts:
            self._delta_prompts(mixed, z, b, a, conv, state, layer, batch, prompts, out)
            return out
        with one_torch_thread():  # small per-row ops: more threads only wait for each other (docs/benchmarks.md)
            for r in prompts:  # the reference path: every prompt chunk on its own
                first, n = batch.spans[r]
                sl = slice(first, first + n)
                marks = self._marks(batch, r)
                out[sl] = self._delta_chunk(mixed[sl], z[sl], b[sl], a[sl], conv, state, batch.slots[r],
                                            batch.fresh[r], layer, marks)
                self._capture(batch, r, marks)
        return out

    @staticmethod
    def _capture(batch: HybridBatch, r: int, marks: dict[int, Any]) -> None:
        """File row ``r``'s snapshots (chunk offset -> copy) under the prompt position the state stands at."""
        if not marks:
            return
        start = int(batch.pos_of[batch.spans[r][0]])
        for at, snap in marks.items():
            batch.captured.setdefault(r, {}).setdefault(start + at, []).append(snap)

    def _delta_prompts(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       conv: torch.Tensor, state: torch.Tensor, layer: gdn.GdnLayer, batch: HybridBatch,
                       rows: list[int], out: torch.Tensor) -> None:
        """Every prompt chunk of the cycle at once: the convolution, SiLU, q/k norms, gates and the gated
        norm run once over all their tokens packed together (each row's segment behind its stored
        window; the outputs that straddle two segments are dropped); only the chunked delta rule runs
        per row, taking the prefix-cache copies at its block ends (``marks``). Writes ``out``'s rows."""
        spans = [batch.spans[r] for r in rows]
        kernel = conv.shape[-1]
        dev = mixed.device
        contiguous = all(spans[j][0] + spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1))
        if contiguous:
            tok: slice | torch.Tensor = slice(spans[0][0], spans[-1][0] + spans[-1][1])
        else:
            tok = torch.tensor([f + i for f, n in spans for i in range(n)], device=dev)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[tok] if isinstance(tok, slice) else t.index_select(0, tok)

        slots = torch.tensor([batch.slots[r] for r in rows], dtype=torch.long, device=dev)
        windows = conv.index_select(0, slots)  # [rows, conv_dim, kernel] (a copy)
        for j, r in enumerate(rows):
            if batch.fresh[r]:
                windows[j].zero_()
        m = pick(mixed).t().to(conv.dtype)  # [conv_dim, tokens]
        pieces: list[torch.Tensor] = []
        seg: list[int] = []  # where each row's segment (window, then its tokens) starts in `full`
        outs_at: list[int] = []
        ends: list[int] = []
        at = tok_at = 0
        for j, (_, n) in enumerate(spans):
            pieces += [windows[j], m[:, tok_at:tok_at + n]]
            seg.append(at)
            outs_at.extend(range(at + 1, at + 1 + n))  # the conv output whose window ends at each token
            ends.extend(range(at + n, at + n + kernel))  # the row's new window: its last `kernel` inputs
            at += kernel + n
            tok_at += n
        full = torch.cat(pieces, -1)  # [conv_dim, sum(kernel + n)]
        conv.index_copy_(0, slots, full.index_select(1, torch.tensor(ends, device=dev))
                         .view(-1, len(rows), kernel).transpose(0, 1))
        y = F.conv1d(full[None], layer.conv_w[:, None, :], groups=full.shape[0])[0]
        y = F.silu(y.index_select(1, torch.tensor(outs_at, device=dev)).t())
        q, k, v = gdn.heads(y, layer)
        g, beta = gdn.gates(pick(a), pick(b), layer)
        o = q.new_empty(q.shape[0], layer.v_heads, layer.v_dim)
        tok_at = 0
        with one_torch_thread():  # small per-row ops: more threads only wait for each other (docs/benchmarks.md)
            for j, r in enumerate(rows):
                n = spans[j][1]
                sl = slice(tok_at, tok_at + n)
                marks = self._marks(batch, r)
                s0 = None if batch.fresh[r] else state[batch.slots[r]]  # None: empty (cheaper first block)
                o[sl], state[batch.slots[r]] = gdn.chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], s0, marks=marks)
                for end in marks:  # the conv window at each mark: the `kernel` inputs before it
                    marks[end] = (full[:, seg[j] + end:seg[j] + end + kernel].clone(), marks[end])
                self._capture(batch, r, marks)
                tok_at += n
        normed = gdn.gated_norm(o, pick(z), layer)
        if isinstance(tok, slice):
            out[tok] = normed
        else:
            out.index_copy_(0, tok, normed)

    @staticmethod
    def _marks(batch: HybridBatch, r: int) -> dict[int, Any]:
        """Offsets within row ``r``'s chunk (1..n) after which its state is captured (``snap_every``)."""
        every = batch.snap_every
        if not every:
            return {}
        first, n = batch.spans[r]
        start = int(batch.pos_of[first])
        return {p - start: None for p in range((start // every + 1) * every, start + n + 1, every)}

    @staticmethod
    def _delta_chunk(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                     state: torch.Tensor, slot: int, fresh: bool, layer: gdn.GdnLayer,
                     marks: dict[int, Any]) -> torch.Tensor:
        """One row's prompt chunk: the convolution over its stored window and the chunked delta rule.
        ``marks``: offsets after which (conv window, state) copies are put in (the chunk runs in pieces there)."""
        kernel = conv.shape[-1]
        window = conv.new_zeros(conv.shape[1:]) if fresh else conv[slot]
        full = torch.cat([window, mixed.t().to(conv.dtype)], -1)  # [conv_dim, kernel + n]
        conv[slot] = full[:, -kernel:]
        y = F.silu(F.conv1d(full[None], layer.conv_w[:, None, :], groups=full.shape[0])[0, :, 1:]).t()
        q, k, v = gdn.heads(y, layer)
        g, beta = gdn.gates(a, b, layer)
        s = state.new_zeros(state.shape[1:]) if fresh else state[slot]
        outs, at = [], 0
        for end in sorted(marks) + [mixed.shape[0]]:
            if end > at:
                o, s = gdn.chunked(q[at:end], k[at:end], v[at:end], g[at:end], beta[at:end], s)
                outs.append(o)
                at = end
            if end in marks:
                marks[end] = (full[:, end:end + kernel].clone(), s.clone())
        state[slot] = s
        return gdn.gated_norm(torch.cat(outs) if len(outs) > 1 else outs[0], z, layer)

    # -- full attention ---------------------------------------------------------------------------
    def _attention_block(self, x: torch.Tensor, attn: dict[str, Any], i: int, batch: HybridBatch, kv: BlockPool,
                         cache: Any, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Qwen3.5's gated attention for every token over its own row -> o_proj's output ``[tokens, hidden]``."""
        t, d = x.shape[0], self.head_dim
        qg, k, v = self._projections(x, (attn["q_proj"], attn["k_proj"], attn["v_proj"]))
        qg = qg.view(t, self.heads, 2 * d)
        q = _shifted_norm(qg[..., :d], attn["q_norm"], self._ones)
        k = _shifted_norm(k.view(t, self.kv_heads, d), attn["k_norm"], self._ones)
        q, k = self._rotate(q, rope), self._rotate(k, rope)
        v = v.reshape(t, self.kv_heads, d)
        if cache is not None:
            o = cache.attend(q, k, v, i, self.scaling)
        else:
            o = self._gathered_attention(q, k, v, i, batch, kv)
        o = o * torch.sigmoid(qg[..., d:].reshape(t, -1))
        return self._linear(o, attn["o_proj"])

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the first ``rotary_dim`` channels of each head (``x`` ``[tokens, heads, head_dim]``)."""
        rd = self.rotary_dim
        cos, sin = rope[0][:, None, :], rope[1][:, None, :]
        r = x[..., :rd]
        half = rd // 2
        turned = torch.cat((-r[..., half:], r[..., :half]), dim=-1)
        rotated = r * cos + turned * sin
        return rotated if rd == x.shape[-1] else torch.cat([rotated, x[..., rd:]], -1)

    def _gathered_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int, batch: HybridBatch,
                            kv: BlockPool) -> torch.Tensor:
        """Without the kernel: store the keys and values in their blocks, then SDPA over each row's gathered blocks."""
        layer = kv.kv_layer[i]
        kc, vc = kv.keys[layer], kv.values[layer]
        bs = kv.block_size
        blocks = batch.table[batch.row_of, batch.pos_of // bs]
        kc[blocks, batch.pos_of % bs] = k.to(kc.dtype)
        vc[blocks, batch.pos_of % bs] = v.to(vc.dtype)
        out = q.new_empty(q.shape[0], self.heads * self.head_dim)
        for r, (first, n) in enumerate(batch.spans):
            qpos = batch.pos_of[first:first + n]
            length = int(qpos[-1]) + 1
            keys = kc[batch.table[r]].reshape(-1, self.kv_heads, self.head_dim)[:length]
            vals = vc[batch.table[r]].reshape(-1, self.kv_heads, self.head_dim)[:length]
            mask = torch.arange(length, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q[first:first + n].transpose(0, 1), keys.transpose(0, 1),
                                               vals.transpose(0, 1), attn_mask=mask, scale=self.scaling,
                                               enable_gqa=self.groups > 1)
            out[first:first + n] = o.transpose(0, 1).reshape(n, -1)
        return out


def lean_hybrid_for(model: Any, *, pack: bool = False, kernel: Any = None,
                    gdn_kernel: Any = None) -> LeanHybrid | None:
    """A :class:`LeanHybrid` for a Qwen3.5 hybrid it supports, else ``None`` (transformers' forward stays)."""
    if type(model).__name__ not in SUPPORTED:
        return None
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "attention_bias", False):
        return None
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return None
    for layer in model.model.layers:
        mixer = layer._modules.get("linear_attn")
        if mixer is not None and (mixer.conv1d.bias is not None or mixer.activation != "silu"
                                  or mixer.num_v_heads % mixer.num_k_heads):
            return None
        if mixer is None and "self_attn" not in layer._modules:
            return None
        if type(layer.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return None
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return None  # the state kernels and the chunked form run float32
    return LeanHybrid(model, pack=pack, kernel=kernel, gdn_kernel=gdn_kernel)


def batch_of(decoding: Sequence[Any], chunks: Sequence[tuple[Any, int]], kv: BlockPool,
             device: Any, snap_every: int = 0) -> tuple[HybridBatch, list[Any]]:
    """The packed batch of one cycle: one token of each ``decoding`` row (its last generated one), then
    the next ``c`` prompt tokens of each ``(row, c)`` in ``chunks``; rows are the scheduler's (duck-typed:
    ``tokens``, ``prefilled``, ``pos``, ``blocks``, ``generated``, ``adapter_key``, ``state_slot``). Keeps
    the logits of every decode token and of each chunk that completes its prompt; returns those chunk
    rows too. Reads the rows, changes nothing."""
    ids: list[int] = []
    pos: list[int] = []
    spans: list[tuple[int, int]] = []
    keep: list[int] = []
    completing = []
    for r in decoding:
        spans.append((len(ids), 1))
        keep.append(len(ids))
        ids.append(r.generated[-1])
        pos.append(r.pos)
    for r, c in chunks:
        start = r.prefilled
        spans.append((len(ids), c))
        ids.extend(r.tokens[start:start + c])
        pos.extend(range(start, start + c))
        if start + c == len(r.tokens):
            keep.append(len(ids) - 1)
            completing.append(r)
    rows = list(decoding) + [r for r, _ in chunks]
    row_of = [i for i, (_, n) in enumerate(spans) for _ in range(n)]
    keys = tuple(r.adapter_key for r in rows)
    batch = HybridBatch(
        ids=torch.tensor(ids, device=device), row_of=torch.tensor(row_of, device=device),
        pos_of=torch.tensor(pos, device=device), spans=tuple(spans), slots=tuple(r.state_slot for r in rows),
        fresh=tuple([False] * len(decoding) + [r.prefilled == 0 for r, _ in chunks]),
        table=kv.table([r.blocks for r in rows]), keep=torch.tensor(keep, dtype=torch.long, device=device),
        keys=None if all(k == BASE_KEY for k in keys) else keys, snap_every=snap_every)
    return batch, completing
