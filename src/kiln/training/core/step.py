"""How one job's training steps run the model's trunk: plain, layer-checkpointed, compiled.

Both options are per job (:class:`kiln.training.core.loop.Plan`) and change only the
float arithmetic of a step, never what it computes:

* ``gradient_checkpointing``: each decoder layer's forward runs under
  ``torch.utils.checkpoint`` (non-reentrant) while a training step runs, so only
  the layer inputs are kept and each layer is recomputed in backward. Installed
  per step and removed after it: serving between steps runs the plain layers.
  Transformers' own switch (``gradient_checkpointing_enable``) only acts in
  ``train()`` mode, and the served model stays in ``eval()`` mode.
* ``compile``: the trunk is ``torch.compile``d with static shapes; batches are
  right-padded to a multiple of :data:`COMPILE_BUCKET` tokens (causal attention,
  so the padding after a row cannot change it) so one job compiles a few graphs,
  not one per length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.training.losses.chunked import SplitLM

COMPILE_BUCKET = 64  # tokens: compiled batches are right-padded to a multiple of this
COMPILE_CACHE_LIMIT = 32  # graphs dynamo keeps per compiled trunk (buckets x batch heights)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (the first ``ModuleList`` named ``layers``)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(module):
            return module
    raise ValueError("gradient_checkpointing: the model has no `layers` list of decoder layers")


def pad_to_bucket(batch: dict[str, torch.Tensor], pad_id: int, bucket: int = COMPILE_BUCKET) -> dict[str, torch.Tensor]:
    """Right-pad every ``[N, T]`` tensor of ``batch`` to a multiple of ``bucket`` columns.

    Padding carries no loss and no attention (``attention_mask`` 0); ``position_ids``,
    when present, continue counting so the padding stays in the last row's block.
    """
    t = batch["input_ids"].shape[1]
    extra = -t % bucket
    if extra == 0:
        return batch
    out = dict(batch)
    for key in ("input_ids", "attention_mask", "loss_mask"):
        fill = pad_id if key == "input_ids" else 0
        out[key] = torch.nn.functional.pad(batch[key], (0, extra), value=fill)
    if "position_ids" in batch:
        pos = batch["position_ids"]
        more = pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)
        out["position_ids"] = torch.cat([pos, more], dim=1)
    return out


class TrunkRunner:
    """Runs the trunk for one job's training steps, with that job's options."""

    def __init__(self, peft_model: Any, split: SplitLM | None, *, gradient_checkpointing: bool, compile: bool):
        self.layers: list[nn.Module] = list(decoder_layers(peft_model)) if gradient_checkpointing else []
        # One wrapper object per layer for the whole job: a compiled trunk guards on it, and would
        # recompile if it changed from step to step.
        self._wrappers = [partial(checkpoint, layer.forward, use_reentrant=False) for layer in self.layers]
        self.compiled: Any = None
        if compile and split is not None:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, COMPILE_CACHE_LIMIT)
            self.compiled = torch.compile(split.trunk, dynamic=False)

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around one step's forward and backward: install the checkpointed layer forwards, then remove them."""
        for layer, wrapped in zip(self.layers, self._wrappers):
            layer.forward = wrapped
        try:
            yield
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)

    def prepare(self, batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
        """The batch as the trunk will see it (bucket-padded when compiled)."""
        return pad_to_bucket(batch, pad_id) if self.compiled is not None else batch

    def hidden(self, split: SplitLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[N, T, H]`` final-norm hidden states of ``batch`` (with its ``position_ids`` when packed)."""
        if self.compiled is not None:
            return self.compiled(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                                 use_cache=False).last_hidden_state
        return split.hidden(batch["input_ids"], position_ids=batch.get("position_ids"))


def completion_logits(peft_model: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                       device: torch.device) -> torch.Tensor:
    """``[N, V]`` student logits predicting each completion token (N = all completion tokens, in order)."""
    width = max(len(p) + len(c) for p, c in pairs)
    ids = torch.zeros((len(pairs), width), dtype=torch.long, device=device)
    attn = torch.zeros((len(pairs), width), dtype=torch.long, device=device)
    for r, (p, c) in enumerate(pairs):
        seq = list(p) + list(c)
        ids[r, : len(seq)] = torch.tensor(seq, device=device)
        attn[r, : len(seq)] = 1
    logits = peft_model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    out = [logits[r, len(p) - 1: len(p) - 1 + len(c)] for r, (p, c) in enumerate(pairs)]
    return torch.cat(out, dim=0)
