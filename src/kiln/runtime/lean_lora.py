"""LoRA adapters on the lean forward (kiln.runtime.lean_forward): which adapters it can run, and their deltas.

Rows with an adapter used to leave the lean forward for PEFT's module forward with per-row
``adapter_names`` (every LoRA layer splits the batch by adapter, gathers each sub-batch and
scatters its output back, around transformers' per-call Python). On the 31M Qwen3 shape that made a
16-row decode step of a trainer's private adapter (OPD and GRPO sampling) 1.5-2.5x the base
model's step. The lean forward now adds each LoRA layer's delta itself, as PEFT's mixed-batch
forward computes it: ``lora_B(lora_A(x)) * scaling`` added to the frozen layer's output, per group
of rows with the same adapter (one group with every row when the batch has one adapter: no
gather). A fused q|k|v or gate|up projection takes each part's delta in its own output columns.

:class:`LoraSupport` decides per adapter key (cached on the identity of PEFT's config object for
that key, so a key deleted and created again is checked again): only vanilla LoRA on the decoder
layers' q/k/v/o and gate/up/down projections and a hybrid's Gated DeltaNet in/out projections
(no DoRA or other variant, no LoRA bias, no embedding or LM-head LoRA, no ``modules_to_save`` or
trainable tokens, float32 A and B); anything else keeps PEFT's forward. A model in training mode keeps PEFT's forward too (LoRA dropout).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from kiln.runtime.adapter_slots import BASE_KEY as BASE  # PEFT's name for "no adapter" in a mixed batch

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               # a hybrid's Gated DeltaNet projections (kiln.runtime.lean_hybrid)
               "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
LORA_DICTS = ("lora_embedding_A", "lora_magnitude_vector")  # per-key state this path does not implement

Groups = list[tuple[str, "torch.Tensor | None"]]  # (adapter key, batch rows or None for all rows)


class LoraSupport:
    """Which adapter keys the lean forward runs, for the causal LM ``model`` (wrapped in place by PEFT)."""

    def __init__(self, model: Any):
        self.model = model
        self._checked: dict[str, tuple[Any, bool]] = {}  # key -> (PEFT config object, supported)

    def runs(self, keys: Sequence[str], configs: dict[str, Any] | None) -> bool:
        """Whether every row's adapter (``keys``; ``BASE`` for none) can run on the lean forward;
        ``configs``: the PEFT model's ``peft_config`` (``None``: not wrapped)."""
        first = keys[0] if keys else BASE
        if first == BASE and all(k == BASE for k in keys):
            return True
        if configs is None or self.model.training:
            return False
        for key in dict.fromkeys(keys):
            if key == BASE:
                continue
            cfg = configs.get(key)
            seen = self._checked.get(key)
            if seen is None or seen[0] is not cfg:
                seen = self._checked[key] = (cfg, cfg is not None and self._supported(key, cfg))
            if not seen[1]:
                return False
        return True

    def _supported(self, key: str, cfg: Any) -> bool:
        if getattr(cfg, "use_dora", False) or getattr(cfg, "modules_to_save", None) \
                or getattr(cfg, "trainable_token_indices", None) or getattr(cfg, "lora_bias", False):
            return False
        found = False
        for name, mod in self.model.named_modules():
            subs = mod._modules
            if any(key in (getattr(mod, d, None) or {}) for d in LORA_DICTS):
                return False
            a = subs.get("lora_A")
            if a is None or key not in a._modules:
                continue
            parent, _, leaf = name.rpartition(".")
            if leaf not in PROJECTIONS or ".layers." not in f".{parent}." or key in getattr(mod, "lora_variant", {}):
                return False
            la, lb = a._modules[key], subs["lora_B"]._modules[key]
            if not (isinstance(la, torch.nn.Linear) and isinstance(lb, torch.nn.Linear)) \
                    or la.bias is not None or lb.bias is not None \
                    or la.weight.dtype != torch.float32 or lb.weight.dtype != torch.float32:
                return False
            found = True
        return found


def groups_for(keys: Sequence[str], device: Any) -> Groups:
    """The adapter groups of a batch whose rows have adapters ``keys``: ``[]`` when none has one,
    ``[(key, None)]`` when all rows share one, else each key with its rows' indices."""
    distinct = [k for k in dict.fromkeys(keys) if k != BASE]
    if not distinct:
        return []
    if len(distinct) == 1 and len(keys) > 0 and all(k == distinct[0] for k in keys):
        return [(distinct[0], None)]
    return [(k, torch.tensor([i for i, x in enumerate(keys) if x == k], device=device)) for k in distinct]


def add_lora(out: torch.Tensor, x: torch.Tensor, module: Any, groups: Groups) -> torch.Tensor:
    """``out`` (``module``'s frozen output for ``x``, rows on dim 0) plus each group's LoRA delta, in place."""
    subs = module._modules
    lora_a = subs.get("lora_A")
    if lora_a is None:
        return out
    lora_b, scaling = subs["lora_B"]._modules, module.scaling
    for key, rows in groups:
        a = lora_a._modules.get(key)
        if a is None:
            continue
        xs = x if rows is None else x.index_select(0, rows)
        delta = F.linear(F.linear(xs, a._parameters["weight"]), lora_b[key]._parameters["weight"]) * scaling[key]
        if rows is None:
            out += delta
        else:
            out.index_add_(0, rows, delta)
    return out


def add_fused_lora(out: torch.Tensor, x: torch.Tensor, modules: Sequence[Any], widths: Sequence[int],
                   groups: Groups) -> torch.Tensor:
    """``out``: the fused projection of ``modules`` (outputs side by side, ``widths`` each); each part's LoRA
    delta is added to its own columns, in place."""
    at = 0
    for mod, w in zip(modules, widths):
        if "lora_A" in mod._modules:
            add_lora(out[..., at:at + w], x, mod, groups)
        at += w
    return out
