"""A lean forward for Llama-family decoders (Qwen3, Qwen2, Llama): the same math as
transformers' modules, without their per-call Python.

On a small model the engine's step is mostly interpreter time inside transformers'
forward (about 36 module calls per layer-pair, output dataclasses, config attribute
lookups, mask preparation), and that time holds the GIL the HTTP event loop needs.
:class:`LeanForward` runs the same operations in the same order (RMSNorm in fp32,
``F.linear`` on the modules' own weight tensors, the model's own rotary module,
``scaled_dot_product_attention`` with the boolean mask and GQA handled as
transformers' SDPA integration does), so its logits are bitwise those of the
module forward on the same inputs (a test checks it), at a fraction of the Python.

Packed weights (``pack=True``, CPU and float32 only): Linear weights are also kept
reordered for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``) and multiplied with
``mkldnn._linear_pointwise``. On this project's CPUs that ran the 31M-parameter shape's
decode step 2-2.7x faster than ``F.linear`` (MKL sgemm) at 8-32 rows
(docs/benchmarks.md). The packed copies cost as much memory as the Linear weights
themselves, so packed copies are made in module order (decoder layers, then the LM head)
only while their total stays within ``PACKED_WEIGHTS_MAX_BYTES`` and a quarter of RAM
(within a cgroup limit; the Qwen3-0.6B shape's 2.38 GB fit on a 24 GB machine: its packed
151,936 x 1,024 LM head ran a 1-row step in 15 ms against 29 ms with ``F.linear``, 8 rows
in 23 vs 76 ms); what does not fit stays on ``F.linear``. Weights under
``PACK_MIN_ELEMENTS`` are not packed either (on tiny matrices oneDNN's per-call overhead
loses to MKL).

With ``fuse=True`` (the default) the packed path also cuts the step's op count (every
torch op releases and re-takes the GIL the HTTP event loop needs; 657 top-level ops per
step became 312 on the 31M shape): each layer's ``[q; k; v]`` and ``[gate; up]`` weights
are packed as ONE weight each when the joint weight reaches ``PACK_MIN_ELEMENTS`` (biases
concatenated; no separate packs of fused weights are kept) and the outputs are split as
views; q_norm and k_norm run as one ``F.rms_norm`` over the joint q|k heads times a
per-head weight; RoPE rotates q|k at once (``rotate_half(x) * sin`` is ``roll(x, half)``
times the sine with its first half negated, one ``addcmul``); RMSNorm is ``F.rms_norm``;
a boolean mask becomes SDPA's additive mask once per forward instead of in every layer.
Fused packs are keyed by the tuple of the base weights' ``data_ptr()``; a layer whose key
is missing runs its projections one by one. bench/lean_forward.py measured the step
before/after at 5.69/4.62 ms (1 row), 8.57/7.80 (8 rows), 20.50/19.43 (32 rows). The
packed logits differ from the module forward by float rounding (about 5e-6 on the 31M
shape), not bitwise; without packing the path stays bitwise that of transformers. Tried
and dropped: oneDNN's binary ``add`` post-op for the residual adds (slower than a
separate add) and SiLU/mul post-ops on separate gate/up packs (slower than the fused
gate|up matmul plus ``silu`` and ``mul_``).

With a cache that attends in place (kiln.runtime.paged_attention; the engine's decode and
packed steps on the CPU in float32) the attention block is one kernel call per layer: the
raw q|k|v projection goes in, the kernel applies the q/k norms and RoPE, stores the new
keys and values and attends; each residual add runs with the RMSNorm after it as one call,
and RoPE rows come from a cos/sin table the model's rotary module filled once.

It reads each weight through the module tree at every call (from the modules'
``_modules``/``_parameters`` dicts: ``nn.Module.__getattr__`` cost about 0.2 ms per
step), so a model that PEFT has wrapped in place still works: a LoRA layer's frozen ``base_layer`` supplies the
base weights. Rows with a plain LoRA adapter on the decoder's projections (a served adapter or a
trainer's private one) run here too: each LoRA layer adds its delta per group of rows with the same
adapter (kiln.runtime.lean_lora, which also says what stays on PEFT's forward).
Anything it does not recognise (another architecture, a sliding-window layer, a
non-SDPA attention implementation, an activation other than SiLU) makes
:func:`lean_forward_for` return ``None`` and the engine keeps transformers' forward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from kiln.runtime.lean_lora import Groups, LoraSupport, add_fused_lora, add_lora, groups_for
from kiln.runtime.memory import memory_total_bytes
from kiln.runtime.quantize import QuantizedLinear, join_quantized, quantized_head

SUPPORTED = {"Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"}
PACKED_WEIGHTS_MAX_BYTES = 16 << 30  # a second copy of the Linear weights costs this much memory at most,
PACKED_WEIGHTS_RAM_FRACTION = 0.25  # ... and at most this fraction of RAM (within a cgroup limit)
PACK_BATCH_HINT = 16  # rows oneDNN's weight layout is chosen for (it serves any row count)
# Smaller weights stay with F.linear: on the 0.37M built-in model (hidden 128) oneDNN's per-call
# overhead made the engine's step slower (CPU per token 0.99 vs 0.53 ms at one row).
PACK_MIN_ELEMENTS = 1 << 17


def _weight(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    # straight from the module's dicts: nn.Module.__getattr__ (and the AttributeError a missing
    # base_layer raises inside it) cost more per step than the small ops
    base = module._modules.get("base_layer", module)  # a PEFT LoRA layer wraps the frozen Linear
    params = base._parameters
    if params.get("weight") is not None:
        return params["weight"], params.get("bias")
    if isinstance(base, QuantizedLinear):  # quantized (kiln.runtime.quantize): no float weight, its own kernel
        return None, None
    base = getattr(module, "base_layer", module)
    return base.weight, base.bias


def _norm(h: torch.Tensor, norm: Any, fused: bool) -> torch.Tensor:
    """RMSNorm module ``norm`` on ``h``: ``F.rms_norm`` when ``fused`` (float32), else op for op as transformers."""
    weight = norm._parameters["weight"]
    if fused:
        return F.rms_norm(h, (h.shape[-1],), weight, norm.variance_epsilon)
    return _rms(h, weight, norm.variance_epsilon)


def _c_norm(kernel: Any, h: torch.Tensor, delta: torch.Tensor | None, norm: Any) -> torch.Tensor:
    """``h += delta`` in place, then ``norm``'s RMSNorm of ``h``, by the paged-attention kernel library."""
    return kernel.add_rms_norm(h, delta, norm._parameters["weight"], norm.variance_epsilon)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanForward:
    """``logits = lean(input_ids, position_ids, attention_mask, cache, logits_to_keep)`` for one model."""

    def __init__(self, model: Any, *, pack: bool = False, fuse: bool = True):
        self.model = model
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.groups = self.heads // self.kv_heads
        self.scaling = self.head_dim ** -0.5
        self._packed: dict[int, torch.Tensor] = {}  # weight data_ptr -> oneDNN-packed copy
        # (data_ptr of each base weight) -> (packed copy of the weights concatenated along out-features, biases)
        self._fused: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        # (data_ptr of each quantized base's qweight) -> the joint c-kernel layer (kiln.runtime.quantize.join_quantized)
        self._qfused: dict[tuple[int, ...], QuantizedLinear] = {}
        # (q_norm, k_norm weight data_ptr) -> [heads + kv_heads, 1, head_dim]: both norms in one pass
        self._qk_norm: dict[tuple[int, int], torch.Tensor] = {}
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin rows by position (in place)
        self.lora = LoraSupport(model)  # which adapters' rows run here (kiln.runtime.lean_lora)
        self._groups: Groups = []  # during a call: the batch's adapter groups (each LoRA layer adds their deltas)
        # packed copies are made in module order (the decoder layers, then the LM head) while they fit
        # in PACKED_WEIGHTS_MAX_BYTES; what does not fit stays on F.linear
        self._pack_budget = _pack_cap()
        if pack and _packable(model):
            with torch.no_grad():
                for layer in model.model.layers:  # layer by layer, so a cap leaves whole early layers packed
                    if fuse:
                        self._fuse(layer)
                    self._pack_each(layer)
                self._pack_each(model)  # what is left: the LM head

    def _pack_each(self, root: Any) -> None:
        """A packed copy of each Linear weight under ``root`` not packed yet (fused ones included)."""
        fused = {p for key in self._fused for p in key}  # their separate packs would be a third copy
        for mod in root.modules():
            # an LM head with an int8 inference copy infers through it: a packed float copy would be a third
            if type(mod) is torch.nn.Linear and mod.weight.numel() >= PACK_MIN_ELEMENTS and quantized_head(mod) is None:
                w = mod.weight
                if w.data_ptr() not in fused and w.data_ptr() not in self._packed and self._afford(w):
                    self._packed[w.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)

    def _afford(self, weight: torch.Tensor) -> bool:
        """Whether a packed copy of ``weight`` still fits the budget (and spend it if so)."""
        nbytes = weight.numel() * weight.element_size()
        if nbytes > self._pack_budget:
            return False
        self._pack_budget -= nbytes
        return True

    def _fuse(self, layer: Any) -> None:
        """Packs ``[q; k; v]`` and ``[gate; up]`` of ``layer`` as one weight each (and the joint q|k norm)."""
        attn, mlp = layer.self_attn, layer.mlp
        self._fuse_group((attn.q_proj, attn.k_proj, attn.v_proj))
        self._fuse_group((mlp.gate_proj, mlp.up_proj))
        if hasattr(attn, "q_norm") and attn.q_norm.variance_epsilon == attn.k_norm.variance_epsilon:
            qw, kw = attn.q_norm.weight, attn.k_norm.weight
            per_head = torch.cat([qw.expand(self.heads, -1), kw.expand(self.kv_heads, -1)])
            self._qk_norm[(qw.data_ptr(), kw.data_ptr())] = per_head[:, None, :]

    def _fuse_group(self, mods: tuple[Any, ...]) -> None:
        """Packs the Linear layers ``mods`` (same input) as ONE weight, their outputs side by side."""
        parts = [_weight(m) for m in mods]
        if any(w is None for w, _ in parts):
            self._join_quantized(mods)
            return
        if sum(w.numel() for w, _ in parts) < PACK_MIN_ELEMENTS:
            return
        biases = [b for _, b in parts]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return  # a bias on some parts only: keep them separate
        joint = torch.cat([w for w, _ in parts])  # [sum of out-features, in-features]
        if not self._afford(joint):
            return
        bias = None if biases[0] is None else torch.cat(biases)
        self._fused[tuple(w.data_ptr() for w, _ in parts)] = (
            torch.ops.mkldnn._reorder_linear_weight(joint, PACK_BATCH_HINT), bias)

    def _join_quantized(self, mods: tuple[Any, ...]) -> None:
        """Quantized projections with one input: one c-kernel call for all (their buffers become views)."""
        bases = [m._modules.get("base_layer", m) for m in mods]
        if all(isinstance(b, QuantizedLinear) for b in bases):
            joint = join_quantized(bases)
            if joint is not None:
                self._qfused[tuple(b.qweight.data_ptr() for b in bases)] = joint

    @property
    def packed(self) -> bool:
        return bool(self._packed or self._fused)

    @property
    def fused(self) -> bool:
        """Whether any projections run as one joint matmul (:meth:`_fused_linear`)."""
        return bool(self._fused or self._qfused)

    def _linear(self, x: torch.Tensor, module: Any) -> torch.Tensor:
        w, bias = _weight(module)
        packed = self._packed.get(w.data_ptr()) if self._packed and w is not None else None
        if w is None:  # a quantized base layer: its kernel (kiln.runtime.quantize)
            out = module._modules.get("base_layer", module)._matmul_biased(x)
        elif packed is None:
            out = F.linear(x, w, bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return add_lora(out, x, module, self._groups) if self._groups else out

    def _fused_linear(self, x: torch.Tensor, mods: tuple[Any, ...]) -> torch.Tensor | None:
        """``x`` through the fused pack of ``mods`` (outputs side by side), or ``None`` when there is none."""
        weights = [_weight(m)[0] for m in mods]
        if weights[0] is None:  # quantized bases: their joint layer, if one was made
            bases = [m._modules.get("base_layer", m) for m in mods]
            joint = self._qfused.get(tuple([b.qweight.data_ptr() for b in bases])) if self._qfused else None
            if joint is None:
                return None
            out = joint._matmul_biased(x)
            widths = [b.out_features for b in bases]
        else:
            entry = self._fused.get(tuple([w.data_ptr() for w in weights]))
            if entry is None:
                return None
            out = torch.ops.mkldnn._linear_pointwise(x, entry[0], entry[1], "none", [], "")
            widths = [w.shape[0] for w in weights]
        if self._groups:
            add_fused_lora(out, x, mods, widths, self._groups)
        return out

    def runs(self, keys: Sequence[str], configs: dict[str, Any] | None) -> bool:
        """Whether a batch whose rows have adapters ``keys`` (``__base__``: none) runs here
        (:class:`kiln.runtime.lean_lora.LoraSupport`); ``configs``: the PEFT model's ``peft_config``."""
        return self.lora.runs(keys, configs)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 cache: Any, logits_to_keep: int | torch.Tensor, keys: Sequence[str] | None = None) -> torch.Tensor:
        """Logits; ``keys``: each batch row's adapter key (``None``: no adapter), which :meth:`runs` accepted."""
        self._groups = groups_for(keys, input_ids.device) if keys else []
        try:
            return self._forward(input_ids, position_ids, attention_mask, cache, logits_to_keep)
        finally:
            self._groups = []

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 cache: Any, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        from transformers.modeling_utils import slice_logits_to_keep

        lm = self.model  # PEFT wraps the layers in place: this object stays the causal LM
        inner = lm.model
        h = getattr(inner.embed_tokens, "base_layer", inner.embed_tokens)(input_ids)
        b, t = input_ids.shape
        fast = self.fused and h.dtype == torch.float32
        # the cache may attend in place (its kernel library): one query token per row (decode) or one
        # packed row (b == 1); the library then also does each residual add with the RMSNorm after it
        # (one call instead of add + six ATen ops), so x is always the normalised input of the next block
        in_place = getattr(cache, "in_place", None)
        kern = in_place[0] if in_place is not None else None
        if kern is not None and b != 1 and t != 1:
            raise ValueError("in-place paged attention takes [rows, 1] or [1, tokens] queries")
        if kern is not None:  # the kernel rotates: cos/sin rows per token, [tokens, head_dim]
            rope = self._rope_rows(inner, h, position_ids.reshape(-1))
        else:
            cos, sin = inner.rotary_emb(h, position_ids)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if kern is None and fast:  # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated), bitwise
            half = self.head_dim // 2
            sin_r = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            if attention_mask is not None and attention_mask.dtype == torch.bool:  # SDPA: this, in each layer
                attention_mask = torch.full_like(attention_mask, float("-inf"), dtype=h.dtype).masked_fill_(
                    attention_mask, 0.0)
        layers = inner.layers
        if kern is not None:
            x = _c_norm(kern, h, None, layers[0]._modules["input_layernorm"]) if len(layers) else h
        for i, layer in enumerate(layers):
            sub = layer._modules
            attn, mlp = sub["self_attn"]._modules, sub["mlp"]._modules
            if kern is None:
                x = _norm(h, sub["input_layernorm"], fast)
            qkv = self._fused_linear(x, (attn["q_proj"], attn["k_proj"], attn["v_proj"])) if fast else None
            if kern is not None:  # norm, RoPE, KV store and attention in one kernel call (kiln.runtime.paged_attention)
                o = self._attend_in_place(x, qkv, attn, cache, i, rope).view(b, t, -1)
            else:
                if qkv is not None:
                    q, k, v = self._fused_qkv(qkv, attn, b, t, cos, sin_r)
                else:
                    q, k, v = self._separate_qkv(x, attn, b, t, cos, sin)
                k, v = cache.update(k, v, i)
                o = self._attention(q, k, v, attention_mask, b, t)
            if kern is not None:
                x = _c_norm(kern, h, self._linear(o, attn["o_proj"]), sub["post_attention_layernorm"])
            else:
                h = h + self._linear(o, attn["o_proj"])
                x = _norm(h, sub["post_attention_layernorm"], fast)
            gu = self._fused_linear(x, (mlp["gate_proj"], mlp["up_proj"])) if fast else None
            if gu is not None:
                g, u = gu.chunk(2, dim=-1)
                delta = self._linear(F.silu(g).mul_(u), mlp["down_proj"])
            else:
                lin = self._linear
                delta = lin(F.silu(lin(x, mlp["gate_proj"])) * lin(x, mlp["up_proj"]), mlp["down_proj"])
            if kern is not None:
                following = layers[i + 1]._modules["input_layernorm"] if i + 1 < len(layers) else inner.norm
                x = _c_norm(kern, h, delta, following)
            else:
                h = h + delta
        h = x if kern is not None else _norm(h, inner.norm, fast)
        h = slice_logits_to_keep(h, logits_to_keep)
        return self._head(h, lm.lm_head)

    def _head(self, h: torch.Tensor, lm_head: Any) -> torch.Tensor:
        """The LM head's logits: its int8 inference copy where it has one (kiln.runtime.quantize.quantize_head)."""
        head = quantized_head(lm_head)
        return self._linear(h, lm_head) if head is None else head._matmul_biased(h)

    def _rope_rows(self, inner: Any, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin rows ``[tokens, head_dim]`` for ``positions``, looked up in a table the model's
        own rotary module computed once for positions 0..n-1 (n doubles as longer positions come):
        its rows are a product and a cos/sin per element, so they equal a per-step call bitwise,
        without the module's ~10 ops and decorators per step (default RoPE only: lean_forward_for
        refuses the others)."""
        table = self._rope_table
        top = int(positions.max()) + 1
        if table is None or table[0].shape[0] < top or table[0].dtype != h.dtype or table[0].device != h.device:
            n = 1 << max(63, top - 1).bit_length()
            cos, sin = inner.rotary_emb(h, torch.arange(n, device=h.device)[None])
            table = self._rope_table = (cos[0].contiguous(), sin[0].contiguous())
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _attend_in_place(self, x: torch.Tensor, qkv: torch.Tensor | None, attn: dict[str, Any], cache: Any,
                         layer: int, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The raw q, k, v projections of ``x`` (``[b, t, ...]`` with ``b == 1`` or ``t == 1``:
        tokens in row order) handed to the cache's kernel with the q/k norm weights and RoPE rows."""
        d, nq, nkv = self.head_dim, self.heads, self.kv_heads
        tokens = x.shape[0] * x.shape[1]
        if qkv is not None:
            q, k, v = qkv.view(tokens, nq + 2 * nkv, d).split([nq, nkv, nkv], dim=1)
        else:
            lin = self._linear
            q = lin(x, attn["q_proj"]).view(tokens, nq, d)
            k = lin(x, attn["k_proj"]).view(tokens, nkv, d)
            v = lin(x, attn["v_proj"]).view(tokens, nkv, d)
        qk_norm = None
        if "q_norm" in attn:
            qn, kn = attn["q_norm"], attn["k_norm"]
            qk_norm = (qn._parameters["weight"], kn._parameters["weight"], qn.variance_epsilon)
        return cache.attend(q, k, v, layer, self.scaling, qk_norm=qk_norm, rope=rope)

    def _separate_qkv(self, x: torch.Tensor, attn: dict[str, Any], b: int, t: int, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[b, heads, t, d]`` from three projections (``attn``: the attention's submodules),
        op for op as transformers' attention."""
        d, lin = self.head_dim, self._linear
        q = lin(x, attn["q_proj"]).view(b, t, -1, d)
        k = lin(x, attn["k_proj"]).view(b, t, -1, d)
        v = lin(x, attn["v_proj"]).view(b, t, -1, d).transpose(1, 2)
        if "q_norm" in attn:
            q = _norm(q, attn["q_norm"], False)
            k = _norm(k, attn["k_norm"], False)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        return q, k, v

    def _fused_qkv(self, qkv: torch.Tensor, attn: dict[str, Any], b: int, t: int, cos: torch.Tensor,
                   sin_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[b, heads, t, d]`` as views of the fused projection: q|k normed and rotated as one tensor."""
        d, nq, nkv = self.head_dim, self.heads, self.kv_heads
        qk, v = qkv.view(b, t, -1, d).transpose(1, 2).split([nq + nkv, nkv], dim=1)
        if "q_norm" in attn:
            qn, kn = attn["q_norm"], attn["k_norm"]
            joint = self._qk_norm.get((qn._parameters["weight"].data_ptr(), kn._parameters["weight"].data_ptr()))
            if joint is None:
                q, k = qk.split([nq, nkv], dim=1)
                qk = torch.cat((_norm(q, qn, False), _norm(k, kn, False)), 1)
            else:
                qk = F.rms_norm(qk, (d,), None, qn.variance_epsilon).mul_(joint)
        qk = torch.addcmul(qk * cos, torch.roll(qk, d // 2, -1), sin_r)
        q, k = qk.split([nq, nkv], dim=1)
        return q, k, v

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, b: int,
                   t: int) -> torch.Tensor:
        """SDPA over the gathered cache, GQA as transformers' SDPA integration; output ``[b, t, heads * d]``."""
        d, groups = self.head_dim, self.groups
        if groups > 1:
            if t == 1:  # as transformers' pack_gqa: the query heads of one KV head side by side
                q = q.reshape(b, q.shape[1] // groups, groups, d)
            else:
                kvh, kl = k.shape[1], k.shape[2]
                k = k[:, :, None].expand(b, kvh, groups, kl, d).reshape(b, kvh * groups, kl, d)
                v = v[:, :, None].expand(b, kvh, groups, kl, d).reshape(b, kvh * groups, kl, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling, is_causal=False)
        if t == 1:  # [b, heads, 1, d] or GQA's [b, kv_heads, groups, d]: already in the order of [b, 1, heads * d]
            return o.reshape(b, 1, -1)
        return o.reshape(o.shape[0], -1, t, d).transpose(1, 2).reshape(b, t, -1)


def _pack_cap() -> int:
    """Bytes the packed copies may take: ``PACKED_WEIGHTS_MAX_BYTES``, at most
    ``PACKED_WEIGHTS_RAM_FRACTION`` of RAM (within a cgroup limit; packing is CPU only)."""
    return min(PACKED_WEIGHTS_MAX_BYTES, int(memory_total_bytes("cpu") * PACKED_WEIGHTS_RAM_FRACTION))


def _packable(model: Any) -> bool:
    """oneDNN packing: float32 weights on the CPU and oneDNN present (the memory cap is applied per weight)."""
    if not torch.backends.mkldnn.is_available():
        return False
    linears = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]  # quantized ones are not packed
    return bool(linears) and all(w.device.type == "cpu" and w.dtype == torch.float32 for w in linears)


def lean_forward_for(model: Any, *, pack: bool = False, fuse: bool = True) -> LeanForward | None:
    """A :class:`LeanForward` for ``model`` when it is a supported, plain decoder; else ``None``."""
    if type(model).__name__ not in SUPPORTED:
        return None
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return None
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return None
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return None
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return None  # other RoPE types (dynamic, YaRN, ...) may update state per call: keep transformers' path
    for layer in model.model.layers:
        if type(layer.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return None
        if getattr(layer.self_attn, "sliding_window", None):
            return None
    return LeanForward(model, pack=pack, fuse=fuse)
