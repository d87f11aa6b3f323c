"""One OPD optimizer step's loss: the student's completion positions against the teacher's rows.

Shared by on-policy OPD (:mod:`kiln.training.opd.job`), off-policy OPD (:mod:`kiln.training.opd.offline`)
and the rehearsal rows (:mod:`kiln.training.core.rehearsal`), which import it and nothing of each other.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from kiln.training.core.loop import Piece, row_groups
from kiln.training.core.step import completion_logits
from kiln.training.losses.opd import CANDIDATE_LOSSES, SampledTokenLoss, candidates, teacher_token_logp


class LossSettings(Protocol):
    """What :func:`opd_loss` reads of a job's data (:class:`kiln.training.opd.job.OPDData`)."""

    @property
    def loss(self) -> str: ...

    @property
    def top_k(self) -> int: ...

    @property
    def ce_weight(self) -> float: ...

    @property
    def temperature(self) -> float: ...


def opd_loss(peft_model: Any, split: Any, data: LossSettings, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
             rows: Sequence[dict[int, float]], sampled: Sequence[int],
             gold: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_id: int, device: Any) -> torch.Tensor:
    """One step's loss (with gradient) over the completion tokens of ``pairs`` ((student prompt, completion)),
    whose teacher rows are ``rows`` (one per completion token, in order), plus ``ce_weight`` x CE on ``gold``.

    With ``split`` (:func:`kiln.training.losses.chunked.split_causal_lm`) one trunk forward serves both, and
    the head runs only at completion positions and keeps only the candidate columns
    (:mod:`kiln.training.opd.head`); otherwise the model's full logits are used."""
    from kiln.training.losses.chunked import linear_cross_entropy_sum, linear_token_logprobs
    from kiln.training.opd.head import candidate_loss_mean, completion_hidden

    n_tok = len(sampled)
    targets = torch.tensor(list(sampled), dtype=torch.long, device=device)
    gold = [g for g in gold if g[1]]
    if data.loss == "sampled_token":
        teacher_lp = teacher_token_logp(rows, sampled).to(device)
    else:
        ids, lp, mask = candidates(rows, sampled, data.top_k, include_sampled=data.loss != "renormalized",
                                   device=device)
        loss_cls = CANDIDATE_LOSSES[data.loss]
    if split is not None:
        # a gold row that a completion starts with (the teacher path's CE on its own path row) reuses that
        # row's hidden states instead of running through the trunk again
        starts, at = [], 0
        for _, c in pairs:
            starts.append(at)
            at += len(c)
        reuse = [next((starts[k] for k, (p, c) in enumerate(pairs)
                       if list(p) == list(gp) and list(c[:len(g)]) == list(g)), None) for gp, g in gold]
        h_all = completion_hidden(split, list(pairs) + [g for g, r in zip(gold, reuse) if r is None], pad_id, device)
        h, weight = h_all[:n_tok], split.head.weight
        pieces, extra = [], n_tok
        for (_, g), r in zip(gold, reuse):
            if r is None:
                r, extra = extra, extra + len(g)
            pieces.append(h_all[r:r + len(g)])
        if data.loss == "sampled_token":
            with torch.no_grad():
                behaviour = sampler_logp(data.temperature, lambda t: linear_token_logprobs(
                    h.detach() / t, weight, targets), n_tok, device)
            loss = SampledTokenLoss()(linear_token_logprobs(h, weight, targets), teacher_lp, behaviour)
        else:
            loss = candidate_loss_mean(h, weight, ids, lambda logq, rows: loss_cls.from_logq(
                logq, lp[rows], mask[rows]) * logq.shape[0])
        if gold:
            gold_targets = torch.tensor([t for _, g in gold for t in g], dtype=torch.long, device=device)
            ce = linear_cross_entropy_sum(torch.cat(pieces), weight, gold_targets) / gold_targets.numel()
            loss = loss + data.ce_weight * ce
        return loss
    logits = completion_logits(peft_model, pairs, device).float()
    if data.loss == "sampled_token":
        logq = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        with torch.no_grad():
            behaviour = sampler_logp(data.temperature, lambda t: torch.log_softmax(logits.detach() / t, -1).gather(
                -1, targets[:, None])[:, 0], n_tok, device)
        loss = SampledTokenLoss()(logq, teacher_lp, behaviour)
    else:
        loss = loss_cls()(logits, ids, lp, mask)
    if gold:
        loss = loss + data.ce_weight * gold_ce(peft_model, None, gold, pad_id=pad_id, device=device)
    return loss


def gold_ce(peft_model: Any, split: Any, gold: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_id: int,
            device: Any) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of ``gold`` ((prompt, target) pairs): :func:`opd_loss`'s gold term
    without its weight, computed alone (a piece of a sliced step)."""
    from kiln.training.losses.chunked import linear_cross_entropy_sum
    from kiln.training.opd.head import completion_hidden

    targets = torch.tensor([t for _, g in gold for t in g], dtype=torch.long, device=device)
    if split is not None:
        h = completion_hidden(split, list(gold), pad_id, device)
        return linear_cross_entropy_sum(h, split.head.weight, targets) / targets.numel()
    return nn.functional.cross_entropy(completion_logits(peft_model, gold, device).float(), targets)


def opd_pieces(peft_model: Any, split: Any, data: LossSettings, batch: Any, limit: int, *, pad_id: int,
               device: Any) -> list[Piece]:
    """One OPD step (``batch``: pairs, teacher rows, sampled tokens, gold) cut for bounded holds: groups of
    completions within ``limit`` tokens (the distillation term, a token mean: each group weighs its share of the
    completion tokens), then groups of gold rows (``ce_weight`` x their share of the gold tokens). Their sum is
    :func:`opd_loss` of the whole batch."""
    pairs, rows, sampled, gold = batch
    ends = [0]
    for _, c in pairs:
        ends.append(ends[-1] + len(c))
    sizes = [len(p) + len(c) for p, c in pairs]
    pieces = []
    for g in row_groups(sizes, limit):
        lo, hi = ends[g.start], ends[g.stop]
        if hi > lo:
            pieces.append(Piece(partial(opd_loss, peft_model, split, data, pairs[g.start:g.stop], rows[lo:hi],
                                        sampled[lo:hi], [], pad_id=pad_id, device=device),
                                (hi - lo) / len(sampled), sum(sizes[i] for i in g)))
    gold = [x for x in gold if x[1]]
    n_gold = sum(len(t) for _, t in gold)
    if gold and data.ce_weight:
        for g in row_groups([len(p) + len(t) for p, t in gold], limit):
            part = gold[g.start:g.stop]
            pieces.append(Piece(partial(gold_ce, peft_model, split, part, pad_id=pad_id, device=device),
                                data.ce_weight * sum(len(t) for _, t in part) / n_gold,
                                sum(len(p) + len(t) for p, t in part)))
    return pieces


def sampler_logp(temperature: float, at: Any, n: int, device: Any) -> torch.Tensor | None:
    """Log-probabilities of the sampled tokens under the sampling policy: ``at(T)`` at temperature ``T``,
    ``None`` at 1 (the trained policy itself), zeros at 0 (greedy: each token had probability 1)."""
    if temperature == 1.0:
        return None
    if temperature == 0.0:
        return torch.zeros(n, dtype=torch.float32, device=device)
    return at(temperature)
