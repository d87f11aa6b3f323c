"""Prompt logprobs (vLLM's ``prompt_logprobs``) from one forward pass.

For a prompt ``t_0 .. t_{L-1}`` and logits ``[L, vocab]`` from one forward over
it, position ``i >= 1`` is scored with the distribution the model predicted at
position ``i - 1``. Each row lists the actual token first, then the ``k`` most
likely tokens (best first); a token appearing in both is listed once, so a row
has ``k`` entries when the actual token is in the top ``k`` and ``k + 1`` when it
is not. Ranks are 1-based and count the tokens whose logprob is at least the
token's own; when the actual token is also in the top ``k`` its top-k position
is its rank (the two agree unless logprobs tie). Position 0 has no prediction
and is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScoredToken:
    token_id: int
    logprob: float
    rank: int


PromptLogprobRow = list[ScoredToken]


def prompt_logprob_rows(logits: torch.Tensor, token_ids: list[int], k: int) -> list[PromptLogprobRow | None]:
    """``logits``: ``[L, vocab]`` for ``token_ids`` (length ``L``) -> ``L`` rows, the first ``None``."""
    if len(token_ids) < 2:
        return [None] * len(token_ids)
    logp = logits[:-1].float().log_softmax(-1)  # [L-1, vocab]: prediction for positions 1..L-1
    actual = torch.tensor(token_ids[1:], device=logp.device)
    actual_lp = logp.gather(1, actual[:, None])  # [L-1, 1]
    actual_rank = (logp >= actual_lp).sum(-1)  # [L-1]
    if k > 0:
        top_v, top_i = logp.topk(min(k, logp.shape[-1]), dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    rows: list[PromptLogprobRow | None] = [None]
    for j, (tid, lp, rank) in enumerate(zip(token_ids[1:], actual_lp[:, 0].tolist(), actual_rank.tolist())):
        entries = {tid: ScoredToken(tid, lp, int(rank))}
        if k > 0:  # a top-k entry for the actual token replaces it in place (keeps its first position)
            entries.update((t, ScoredToken(t, v, r + 1)) for r, (t, v) in enumerate(zip(top_i[j], top_v[j])))
        rows.append(list(entries.values()))
    return rows
