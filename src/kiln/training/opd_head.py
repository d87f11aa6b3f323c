"""OPD's student side without ``[B, T, V]`` logits: log-probabilities at completion positions only,
and only in the columns a loss reads.

The OPD losses need, at each completion position ``n``, the student's log-probability
of each candidate ``c`` (teacher top-K plus the sampled token), normalised over the
whole vocabulary: ``z[n, c] - logsumexp_v z[n, v]`` with ``z = h W^T``. The
normaliser needs every column, so the head runs over one chunk of positions at a time
(:func:`kiln.training.chunked_loss.chunk_rows` rows of ``V`` logits) and keeps only
the ``[n, C]`` result; in backward each chunk is recomputed (``torch.utils.checkpoint``)
instead of kept. Shapes: ``N`` positions, ``H`` hidden size, ``V`` vocabulary, ``C``
candidates per position.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from kiln.training.chunked_loss import CHUNK_ELEMENTS, SplitLM, chunk_rows


def _candidate_chunk(hc: torch.Tensor, weight: torch.Tensor, cc: torch.Tensor) -> torch.Tensor:
    z = hc @ weight.t()
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # float32 at least
    return z.gather(-1, cc) - torch.logsumexp(z, dim=-1, keepdim=True)


def linear_candidate_logprobs(h: torch.Tensor, weight: torch.Tensor, cand_ids: torch.Tensor, *,
                              chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``[N, C]`` (float32 at least) ``log softmax(h_n W^T)[cand_ids[n, c]]``.

    Args:
        h: ``[N, H]`` final-norm hidden states at the positions that predict the completion tokens.
        weight: ``[V, H]`` the LM head's weight.
        cand_ids: ``[N, C]`` token IDs (padding entries must be valid IDs; mask them in the loss).
    """
    rows = chunk_rows(weight.shape[0], chunk_elements)
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    out = []
    for s in range(0, h.shape[0], rows):
        args = (h[s:s + rows], weight, cand_ids[s:s + rows])
        out.append(checkpoint(_candidate_chunk, *args, use_reentrant=False) if grad else _candidate_chunk(*args))
    if not out:
        return h.new_zeros((0, cand_ids.shape[-1]), dtype=torch.float32)
    return torch.cat(out)


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
