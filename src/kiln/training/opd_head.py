"""OPD's student side without ``[B, T, V]`` logits: log-probabilities at completion positions only,
and only in the columns a loss reads.

The OPD losses need, at each completion position ``n``, the student's log-probability
of each candidate ``c`` (teacher top-K plus the sampled token), normalised over the
whole vocabulary: ``z[n, c] - logsumexp_v z[n, v]`` with ``z = h W^T``. The
normaliser needs every column, so the head runs over one chunk of positions at a time
(:func:`kiln.training.chunked_loss.chunk_rows` rows of ``V`` logits), evaluates the loss on
the chunk's ``[n, C]`` candidate log-probabilities and computes the gradient right there
(:func:`candidate_loss_mean`): logits are computed once and never kept. Shapes: ``N`` positions, ``H`` hidden size, ``V`` vocabulary, ``C``
candidates per position.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kiln.training.chunked_loss import CHUNK_ELEMENTS, SplitLM, chunk_rows


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


class _CandidateLossSum(torch.autograd.Function):
    """``sum_n f(logq_n)`` over chunks of positions, ``logq = log softmax(h W^T)[cand]``; the gradient is
    computed in forward, one chunk of logits at a time (``f`` is separable over positions), so backward
    is a multiply and the head's logits are computed once, not recomputed."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, cand_ids: torch.Tensor,  # type: ignore[override]
                fn: Any, rows: int) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(h.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for s in range(0, h.shape[0], rows):
            hc, cc = h[s:s + rows], cand_ids[s:s + rows]
            z = (hc @ weight.t()).to(acc)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            logq = (z.gather(-1, cc) - lse).detach().requires_grad_(True)
            with torch.enable_grad():
                part = fn(logq, slice(s, s + hc.shape[0]))
            total += part.detach().to(acc)
            if grad_h is None and grad_w is None:
                continue
            (g,) = torch.autograd.grad(part, logq)
            gz = z.sub_(lse).exp_().mul_(-g.sum(-1, keepdim=True))  # d logq_c / dz_v = [v = c] - softmax_v
            gz.scatter_add_(-1, cc, g)
            gz = gz.to(h.dtype)
            if grad_h is not None:
                torch.mm(gz, weight, out=grad_h[s:s + rows])
            if grad_w is not None:
                grad_w.addmm_(gz.t(), hc)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (need_h, need_w)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = [t * grad.to(t.dtype) for t in ctx.saved_tensors]
        gh = saved.pop(0) if ctx.has[0] else None
        gw = saved.pop(0) if ctx.has[1] else None
        return gh, gw, None, None, None


def candidate_loss_mean(h: torch.Tensor, weight: torch.Tensor, cand_ids: torch.Tensor, fn: Any, *,
                        chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``mean_n f_n``: ``fn(logq, rows)`` returns the SUM of a position-separable loss over the positions
    ``rows`` (a slice) given their candidate log-probabilities ``logq`` ``[n, C]``
    (``log softmax(h W^T)`` at ``cand_ids``). Gradient computed chunk by chunk in forward."""
    if h.shape[0] == 0:
        raise ValueError("candidate_loss_mean: no positions")
    total = _CandidateLossSum.apply(h, weight, cand_ids, fn, chunk_rows(weight.shape[0], chunk_elements))
    return total / h.shape[0]
