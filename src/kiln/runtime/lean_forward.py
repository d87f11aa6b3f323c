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

Packed weights (``pack=True``, CPU and float32 only): each Linear's weight is also
kept reordered for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``) and
multiplied with ``mkldnn._linear_pointwise``. On this project's CPUs that ran the
31M-parameter shape's decode step 2-2.7x faster than ``F.linear`` (MKL sgemm) at 8-32
rows (docs/benchmarks.md); the logits then differ from the module forward by float
rounding (about 5e-6 on that shape), not bitwise. The packed copies cost as much
memory as the Linear weights themselves, so models whose Linear weights exceed
``PACKED_WEIGHTS_MAX_BYTES`` are not packed; weights under ``PACK_MIN_ELEMENTS`` are not
either (on tiny matrices oneDNN's per-call overhead loses to MKL).

It reads each weight through the module tree at every call, so a model that PEFT
has wrapped in place still works: a LoRA layer's frozen ``base_layer`` supplies the
base weights, and the engine uses this path only for rows without an adapter.
Anything it does not recognise (another architecture, a sliding-window layer, a
non-SDPA attention implementation, an activation other than SiLU) makes
:func:`lean_forward_for` return ``None`` and the engine keeps transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED = {"Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"}
PACKED_WEIGHTS_MAX_BYTES = 2 << 30  # a second copy of the Linear weights costs this much memory at most
PACK_BATCH_HINT = 16  # rows oneDNN's weight layout is chosen for (it serves any row count)
# Smaller weights stay with F.linear: on the 0.37M built-in model (hidden 128) oneDNN's per-call
# overhead made the engine's step slower (CPU per token 0.99 vs 0.53 ms at one row).
PACK_MIN_ELEMENTS = 1 << 17


def _weight(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    base = getattr(module, "base_layer", module)  # a PEFT LoRA layer wraps the frozen Linear
    return base.weight, base.bias


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

    def __init__(self, model: Any, *, pack: bool = False):
        self.model = model
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self._packed: dict[int, torch.Tensor] = {}  # weight data_ptr -> oneDNN-packed copy
        if pack and _packable(model):
            with torch.no_grad():
                for mod in model.modules():
                    if isinstance(mod, torch.nn.Linear) and mod.weight.numel() >= PACK_MIN_ELEMENTS:
                        w = mod.weight
                        self._packed[w.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)

    @property
    def packed(self) -> bool:
        return bool(self._packed)

    def _linear(self, x: torch.Tensor, module: Any) -> torch.Tensor:
        w, bias = _weight(module)
        packed = self._packed.get(w.data_ptr()) if self._packed else None
        if packed is None:
            return F.linear(x, w, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 cache: Any, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        from transformers.modeling_utils import slice_logits_to_keep

        lm = self.model  # PEFT wraps the layers in place: this object stays the causal LM
        inner = lm.model
        h = getattr(inner.embed_tokens, "base_layer", inner.embed_tokens)(input_ids)
        cos, sin = inner.rotary_emb(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b, t = input_ids.shape
        d, groups, scale = self.head_dim, self.groups, self.scaling
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            lin = self._linear
            q = lin(x, attn.q_proj).view(b, t, -1, d)
            k = lin(x, attn.k_proj).view(b, t, -1, d)
            v = lin(x, attn.v_proj).view(b, t, -1, d).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q = _rms(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
                k = _rms(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.update(k, v, i)
            mask = attention_mask
            if groups > 1:
                if t == 1:  # as transformers' pack_gqa: the query heads of one KV head side by side
                    q = q.reshape(b, q.shape[1] // groups, groups, d)
                else:
                    kvh, kl = k.shape[1], k.shape[2]
                    k = k[:, :, None].expand(b, kvh, groups, kl, d).reshape(b, kvh * groups, kl, d)
                    v = v[:, :, None].expand(b, kvh, groups, kl, d).reshape(b, kvh * groups, kl, d)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=False)
            o = o.reshape(o.shape[0], -1, t, d).transpose(1, 2).reshape(b, t, -1)
            h = h + lin(o, attn.o_proj)
            x = _rms(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            h = h + lin(F.silu(lin(x, mlp.gate_proj)) * lin(x, mlp.up_proj), mlp.down_proj)
        h = _rms(h, inner.norm.weight, inner.norm.variance_epsilon)
        h = slice_logits_to_keep(h, logits_to_keep)
        return self._linear(h, lm.lm_head)


def _packable(model: Any) -> bool:
    """oneDNN packing: float32 weights on the CPU, oneDNN present, Linear weights within the memory cap."""
    if not torch.backends.mkldnn.is_available():
        return False
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears or any(w.device.type != "cpu" or w.dtype != torch.float32 for w in linears):
        return False
    seen: dict[int, int] = {w.data_ptr(): w.numel() * w.element_size() for w in linears}  # tied weights once
    return sum(seen.values()) <= PACKED_WEIGHTS_MAX_BYTES


def lean_forward_for(model: Any, *, pack: bool = False) -> LeanForward | None:
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
    return LeanForward(model, pack=pack)
