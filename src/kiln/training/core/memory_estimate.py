"""A training job's peak memory beside serving, estimated before it is admitted (pure arithmetic).

The base weights are already resident for serving and shared, so they are not counted again.
What a job adds (bytes, by part):

* ``lora``: the LoRA parameters (``rank x (in + out)`` per targeted Linear), their gradients and
  AdamW's two moments, all float32 (PEFT keeps adapter weights in float32): 16 bytes a parameter;
* ``activations``: ``tokens x layers x hidden x ACTIVATION_FACTOR`` elements of the model dtype kept
  for backward, where ``tokens`` is one step's batch (sequences x the longest sequence). With
  ``gradient_checkpointing`` each layer keeps only its input, and one layer's full set is live;
* ``lm_head_chunk``: the chunked LM head's float32 logits and their gradient for one chunk
  (:data:`kiln.training.losses.chunked.CHUNK_ELEMENTS` elements each);
* ``teacher_topk``: OPD/KD teacher and student top-K buffers (log-probability float32 + token ID int64,
  both sides) for every position of the batch.

The factor is deliberately generous: the estimate is an admission bound, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

# Activation elements kept per hidden unit per layer per token without checkpointing: the attention
# inputs and outputs (q, k, v, o), the MLP's gate/up/activation (about 3 x intermediate ~ 8-10 x hidden)
# and the norms, rounded up.
ACTIVATION_FACTOR = 16
LORA_BYTES_PER_PARAM = 4 + 4 + 8  # float32 weight + gradient + AdamW's two float32 moments
TOPK_BYTES_PER_CANDIDATE = 2 * (4 + 8)  # teacher and student: float32 log-probability + int64 token ID


@dataclass(frozen=True)
class ModelDims:
    """What the estimate needs of the served model."""

    hidden: int
    layers: int
    vocab: int
    dtype_bytes: int
    max_len: int
    linear_dims: dict[str, tuple[tuple[int, int], ...]]  # Linear suffix -> (in, out) of each such module

    def lora_params(self, rank: int, targets: Iterable[str]) -> int:
        return sum(rank * (i + o) for t in targets for i, o in self.linear_dims.get(t, ()))


def model_dims(model: Any, dtype_bytes: int, max_len: int | None) -> ModelDims:
    """Dimensions of a loaded transformers model (torch imported lazily by the caller's model)."""
    import torch

    cfg = getattr(model, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    linear: dict[str, list[tuple[int, int]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lora_" not in name:
            parts = name.split(".")
            if parts[-1] == "base_layer":
                parts = parts[:-1]
            linear.setdefault(parts[-1], []).append((mod.in_features, mod.out_features))
    return ModelDims(int(getattr(text, "hidden_size", 0) or 0), int(getattr(text, "num_hidden_layers", 0) or 0),
                     int(getattr(text, "vocab_size", 0) or 0), dtype_bytes, int(max_len or 2048),
                     {k: tuple(v) for k, v in linear.items()})


def _longest(rows: Iterable[Any]) -> int:
    return max((len(getattr(r, "input_ids", ())) for r in rows), default=0)


def step_shape(kind: str, request: dict[str, Any], data: Any, max_len: int) -> tuple[int, int]:
    """``(sequences, longest sequence)`` of one optimizer step; ``data`` is the plan's payload
    (:class:`kiln.training.sft.job.SFTData`, :class:`~kiln.training.grpo.job.GRPOData`, or another kind's)."""
    batch = int(request.get("batch_size") or 1)
    seq = int(request.get("max_seq_len") or max_len)
    rows = getattr(data, "rows", None)
    if kind == "sft" and rows:
        return min(batch, len(rows)), min(seq, _longest(rows) or seq)
    items = getattr(data, "items", None)
    if kind == "grpo" and items:  # pre-scored groups: every row of batch_size groups
        group = max(len(i.rows) for i in items)
        return min(batch, len(items)) * group, min(seq, max(_longest(i.rows) for i in items) or seq)
    if kind == "grpo":  # rollouts: group_size completions per prompt
        return batch * int(request.get("group_size") or 8), seq
    if kind == "opd":
        return batch * int(request.get("samples_per_prompt") or 1), seq
    return batch, seq


def estimate_job(kind: str, request: dict[str, Any], data: Any, dims: ModelDims) -> dict[str, int]:
    """Bytes a job adds beside serving, by part (see the module docstring)."""
    rank = int(request.get("lora_rank") or 0)
    targets = request.get("lora_target_modules") or ()
    sequences, seq = step_shape(kind, request, data, dims.max_len)
    tokens = sequences * seq
    per_layer = tokens * dims.hidden * dims.dtype_bytes
    if request.get("gradient_checkpointing"):
        activations = per_layer * dims.layers + per_layer * ACTIVATION_FACTOR
    else:
        activations = per_layer * dims.layers * ACTIVATION_FACTOR
    top_k = int(request.get("top_k") or 0) if kind in ("opd", "kd") else 0
    from kiln.training.losses.chunked import CHUNK_ELEMENTS  # torch: imported with the trainer anyway
    return {
        "lora": dims.lora_params(rank, targets) * LORA_BYTES_PER_PARAM,
        "activations": activations,
        "lm_head_chunk": 2 * 4 * min(CHUNK_ELEMENTS, max(tokens, 1) * max(dims.vocab, 1)),
        "teacher_topk": tokens * (top_k + 1) * TOPK_BYTES_PER_CANDIDATE if top_k else 0,
    }


