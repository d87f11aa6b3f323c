"""One clipped GRPO optimizer step, and what it needs: groups with advantages, the behaviour policy's log-probs.

Shared by pre-scored GRPO (:mod:`kiln.training.grpo.job`) and GRPO with rollouts
(:mod:`kiln.training.grpo.rollouts`). Batches are right-padded and the forward passes no attention mask
(see :mod:`kiln.training.core.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch

from kiln.training.core.anchor import anchor_piece, anchor_term
from kiln.training.core.data import Row, collate
from kiln.training.core.loop import Piece, Slicer, TrainLoop, row_groups, sub_batch
from kiln.training.losses.chunked import SplitLM, linear_token_logprobs
from kiln.training.losses.grpo import GRPOLoss, group_advantages
from kiln.training.losses.sft import shifted_token_logprobs


@dataclass(frozen=True)
class GRPOItem:
    """One usable group: its rows and one advantage per row."""

    rows: list[Row]
    advantages: torch.Tensor  # [G]


@dataclass(frozen=True)
class GRPOSettings:
    clip_epsilon: float = 0.2
    scale_rewards: bool = True
    kl_coef: float = 0.0
    kl_estimator: str = "k3"


def grpo_items(groups_rows: Sequence[list[Row]], rewards: Sequence[Sequence[float]], *,
               scale_rewards: bool) -> tuple[list[GRPOItem], int]:
    """Compute advantages; drop zero-variance groups. Returns ``(items, skipped)``."""
    items, skipped = [], 0
    for rows, r in zip(groups_rows, rewards):
        adv = group_advantages(torch.tensor(list(r), dtype=torch.float64), scale_by_std=scale_rewards)
        if adv is None:
            skipped += 1
        else:
            items.append(GRPOItem(list(rows), adv))
    return items, skipped


def _sequence_logprobs(peft_model: Any, batch: dict[str, torch.Tensor], split: SplitLM | None = None,
                       mask: torch.Tensor | None = None, fill: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T-1]`` log-probabilities of each next token (right padding, no mask: see the module docstring).

    With ``split`` the head runs a chunk at a time; with ``mask`` (``[B, T-1]``) too, only
    at the masked positions, the others taken from ``fill`` (``[B, T-1]``, detached).
    """
    ids = batch["input_ids"]
    if split is None:
        return shifted_token_logprobs(peft_model(input_ids=ids, use_cache=False).logits, ids)
    hidden = split.hidden(ids)
    if mask is None:
        b, t = ids.shape
        flat = linear_token_logprobs(hidden[:, :-1].reshape(b * (t - 1), -1), split.head.weight,
                                     ids[:, 1:].reshape(-1))
        return flat.view(b, t - 1)
    assert fill is not None
    rows, cols = mask.bool().nonzero(as_tuple=True)
    chosen = linear_token_logprobs(hidden[rows, cols], split.head.weight, ids[rows, cols + 1])
    return fill.detach().index_put((rows, cols), chosen)


def _padded(rows_logp: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros((len(rows_logp), width), dtype=torch.float32, device=device)
    for i, v in enumerate(rows_logp):
        out[i, : v.numel()] = v
    return out


def policy_logprobs(peft_model: Any, items: Sequence[GRPOItem], pad_id: int, loop: TrainLoop,
                    split: SplitLM | None) -> list[torch.Tensor]:
    """Per row of every item, the current policy's token log-probs (``[len - 1]``), without gradients:
    the ratio's denominator for the GRPO updates that follow. Each group is its own exclusive hold."""
    old: list[torch.Tensor] = []
    for item in items:  # one hold per group (cut between layers while serving waits): serving runs between them
        with torch.no_grad():
            lp = loop.forward_holds(lambda: _sequence_logprobs(peft_model, collate(item.rows, pad_id, loop.device), split))
        old.extend(lp[j, : len(r.input_ids) - 1].clone() for j, r in enumerate(item.rows))
    return old


def row_offsets(items: Sequence[GRPOItem]) -> list[int]:
    """``offsets[g]`` is the index of item ``g``'s first row in the flat per-row list; the last entry is the total."""
    offsets = [0]
    for item in items:
        offsets.append(offsets[-1] + len(item.rows))
    return offsets


@dataclass(frozen=True)
class GRPOBatch:
    """One GRPO step's rows, collated: advantages and the behaviour policy's log-probs beside them."""

    batch: dict[str, torch.Tensor]
    advantages: torch.Tensor  # [B]
    old_logp: torch.Tensor  # [B, T-1], padded

    @property
    def tokens(self) -> int:
        return int(self.batch["attention_mask"].sum())


def grpo_batch(items: Sequence[GRPOItem], chosen: Sequence[int], old: Sequence[torch.Tensor],
               offsets: Sequence[int], *, pad_id: int, device: torch.device) -> GRPOBatch:
    """The rows of ``items[g]`` for ``g`` in ``chosen``; ``old`` holds the behaviour policy's log-probs per
    row (:func:`policy_logprobs`), indexed by ``offsets`` (:func:`row_offsets`)."""
    rows = [r for g in chosen for r in items[g].rows]
    adv = torch.cat([items[g].advantages for g in chosen]).to(device)
    old_lp = [old[offsets[g] + j] for g in chosen for j in range(len(items[g].rows))]
    batch = collate(rows, pad_id, device)
    return GRPOBatch(batch, adv, _padded(list(old_lp), batch["loss_mask"].shape[1] - 1, device))


def grpo_loss(peft_model: Any, loop: TrainLoop, loss_fn: GRPOLoss, settings: GRPOSettings, split: SplitLM | None,
              b: GRPOBatch, *, anchor: Any = None, pad_id: int = 0) -> torch.Tensor:
    """The clipped GRPO loss of one batch (under exclusive ownership, inside :meth:`TrainLoop.train`), plus the
    KL-to-base anchor's term when given (:mod:`kiln.training.core.anchor`); the KL reference is the base model
    (all adapters disabled). Records ``clip_fraction`` and ``kl``. Shared by
    :func:`kiln.training.grpo.job.run_grpo` and :mod:`kiln.training.grpo.rollouts`."""
    mask = b.batch["loss_mask"][:, 1:]
    ref = None
    if settings.kl_coef > 0:
        with torch.no_grad(), peft_model.disable_adapter():
            ref = _sequence_logprobs(peft_model, b.batch, split, mask, b.old_logp)
    logp = _sequence_logprobs(peft_model, b.batch, split, mask, b.old_logp)
    loss, st = loss_fn(logp, b.old_logp, b.advantages, mask, ref)
    if anchor is not None:
        loss = loss + anchor_term(anchor, peft_model, split, loop, pad_id)
    loop.stats.update({"clip_fraction": round(st["clip_fraction"], 4), "kl": round(st["kl"], 6)})
    return loss



def grpo_slicer(peft_model: Any, loop: TrainLoop, loss_fn: GRPOLoss, settings: GRPOSettings, split: SplitLM | None,
                *, anchor: Any = None, pad_id: int = 0) -> Slicer:
    """How a GRPO step is cut when holds are bounded (:meth:`TrainLoop.update`): row micro-batches of the
    token-mean clipped loss (each with its rows' advantages and behaviour log-probs), the anchor rows as one
    more piece. ``clip_fraction`` and ``kl`` are then the last row piece's."""

    def slicer(b: GRPOBatch, limit: int) -> list[Piece]:
        per_row = b.batch["loss_mask"][:, 1:].sum(1).tolist()
        real = b.batch["attention_mask"].sum(1).tolist()
        total = sum(per_row)
        pieces = []
        for g in row_groups(real, limit):
            n = sum(per_row[i] for i in g)
            if n:
                sb = sub_batch(b.batch, g)
                width = sb["input_ids"].shape[1] - 1
                part = GRPOBatch(sb, b.advantages[g.start:g.stop], b.old_logp[g.start:g.stop, :width])
                pieces.append(Piece(partial(grpo_loss, peft_model, loop, loss_fn, settings, split, part),
                                    n / total, int(sum(real[i] for i in g))))
        if anchor is not None:
            pieces.append(anchor_piece(anchor, peft_model, split, loop, pad_id))
        return pieces

    return slicer
