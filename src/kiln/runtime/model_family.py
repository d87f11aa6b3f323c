"""Which model families the built-in engine runs, decided when the model loads.

The engine runs decoders whose every layer is full (causal) attention on its paged KV
cache (Qwen3, Qwen2, Llama-family), and the Qwen3.5 hybrids: Gated DeltaNet
linear-attention layers (per-row recurrent and convolution state,
:mod:`kiln.runtime.linear_state`) beside full-attention layers. Anything else (a
sliding-window or chunked layer type, a linear-attention layer in an architecture whose
state API Kiln has not been tested against, a model with no decoder layer list) is
refused at start-up with a :class:`~kiln.runtime.loader.ModelLoadError` naming the
architecture, never accepted and then failed on the first request.

The published Qwen3.5 checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``
with a ``text_config``); transformers loads their language model alone as
``Qwen3_5ForCausalLM`` (same weights, vision tower skipped), and :func:`describe`
records that so ``/health`` and ``/v1/models`` can say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# causal LM classes whose linear-attention layers use the cache API LinearStepState implements
HYBRID_CLASSES = frozenset({"Qwen3_5ForCausalLM"})


@dataclass(frozen=True)
class ModelFamily:
    """What the engine is running: ``kind`` is ``attention`` or ``hybrid``."""

    kind: str
    architecture: str  # the checkpoint's architecture (config.json ``architectures[0]``)
    loaded_class: str  # the transformers class that runs it
    language_model_only: bool  # a multimodal checkpoint of which only the language model was loaded
    linear_layers: int
    attention_layers: int

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "architecture": self.architecture, "loaded_class": self.loaded_class,
                "language_model_only": self.language_model_only, "linear_attention_layers": self.linear_layers,
                "full_attention_layers": self.attention_layers}


def text_config(config: Any) -> Any:
    """The language model's config (``text_config`` of a multimodal config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's type (``full_attention`` for every layer when the config lists none)."""
    cfg = text_config(config)
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else [FULL_ATTENTION] * int(cfg.num_hidden_layers)


def describe(model: Any, raw_config: dict[str, Any]) -> ModelFamily:
    """The family of a loaded causal LM; raises ``ModelLoadError`` (naming the architecture) when
    the engine cannot run it. ``raw_config`` is the directory's ``config.json``."""
    from kiln.runtime.loader import ModelLoadError

    archs = raw_config.get("architectures") or []
    arch = str(archs[0]) if archs else str(raw_config.get("model_type", "unknown"))
    loaded = type(model).__name__
    where = f"architecture {arch} (loaded as {loaded})"
    inner = getattr(model, "model", None)
    if getattr(inner, "layers", None) is None or not hasattr(model.config, "num_hidden_layers"):
        raise ModelLoadError(f"{where} is not a decoder with a layer list; Kiln's engine cannot run it")
    types = layer_types(model.config)
    other = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if other:
        raise ModelLoadError(f"{where} has {', '.join(other)} layers; Kiln's engine runs full-attention and "
                             "Qwen3.5 Gated DeltaNet layers only")
    linear = types.count(LINEAR_ATTENTION)
    if linear and loaded not in HYBRID_CLASSES:
        raise ModelLoadError(f"{where} has linear-attention layers; Kiln's engine runs those only for "
                             f"{', '.join(sorted(HYBRID_CLASSES))}")
    if linear == len(types):
        raise ModelLoadError(f"{where} has no full-attention layer; Kiln's engine needs at least one")
    return ModelFamily(
        kind="hybrid" if linear else "attention",
        architecture=arch,
        loaded_class=loaded,
        language_model_only=isinstance(raw_config.get("text_config"), dict) and not arch.endswith("ForCausalLM"),
        linear_layers=linear,
        attention_layers=len(types) - linear,
    )


def is_hybrid(config: Any) -> bool:
    """Whether a model config has linear-attention layers (a per-sequence recurrence)."""
    return LINEAR_ATTENTION in layer_types(config)
