"""OPD's student side without ``[B, T, V]`` logits: log-probabilities at completion positions only,
and only in the columns a loss reads.

The OPD losses need, at each completion position ``n``, the student's log-probability
of each candidate ``c`` (teacher top-K plus the sampled token), normalised over the
whole vocabulary: ``z[n, c] - logsumexp_v z[n, v]`` with ``z = h W^T``. The
normaliser needs every column, so the head runs over one chunk of positions at a time
(:func:`kiln.training.losses.chunked.chunk_rows` rows of ``V`` logits), evaluates the loss on
the chunk's ``[n, C]`` candidate log-probabilities and computes the gradient right there
(:func:`candidate_loss_mean`, on :func:`kiln.training.losses.chunked.linear_chunked_loss`): logits
are computed once and never kept. Shapes: ``N`` positions, ``H`` hidden size, ``V`` vocabulary, ``C``
candidates per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.training.losses.chunked import CHUNK_ELEMENTS, SplitLM, chunk_rows, linear_chunked_loss


def completion_hidden(split: SplitLM, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
                      device: Any) -> torch.Tensor:
    """``[N, H]`` hidden states predicting every completion token of ``pairs`` ((prompt, completion) ID lists),
    in order: one right-padded trunk forward without an attention mask (causal: a real token never sees
    the padding after it), then the rows at positions ``len(prompt) - 1 ... len(prompt) + len(completion) - 2``.
    """
    width = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    r_idx: list[int] = []
    c_idx: list[int] = []
    for r, (p, c) in enumerate(pairs):
        seq = list(p) + list(c)
        ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        r_idx.extend([r] * len(c))
        c_idx.extend(range(len(p) - 1, len(p) - 1 + len(c)))
    hidden = split.hidden(ids.to(device))
    return hidden[torch.tensor(r_idx, device=device), torch.tensor(c_idx, device=device)]


def candidate_loss_mean(h: torch.Tensor, weight: torch.Tensor, cand_ids: torch.Tensor, fn: Any, *,
                        chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``mean_n f_n``: ``fn(logq, rows)`` returns the SUM of a position-separable loss over the positions
    ``rows`` (a slice) given their candidate log-probabilities ``logq`` ``[n, C]``
    (``log softmax(h W^T)`` at ``cand_ids``). Gradient computed chunk by chunk in forward."""
    if h.shape[0] == 0:
        raise ValueError("candidate_loss_mean: no positions")
    def chunk(z: torch.Tensor, sl: slice, need_grad: bool) -> tuple[tuple[torch.Tensor], torch.Tensor | None]:
        cc = cand_ids[sl]
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        logq = (z.gather(-1, cc) - lse).detach().requires_grad_(True)
        with torch.enable_grad():
            part = fn(logq, sl)
        value = (part.detach().to(z.dtype),)
        if not need_grad:
            return value, None
        (g,) = torch.autograd.grad(part, logq)
        gz = z.sub_(lse).exp_().mul_(-g.sum(-1, keepdim=True))  # d logq_c / dz_v = [v = c] - softmax_v
        return value, gz.scatter_add_(-1, cc, g)

    return linear_chunked_loss(h, weight, chunk_rows(weight.shape[0], chunk_elements), chunk) / h.shape[0]
