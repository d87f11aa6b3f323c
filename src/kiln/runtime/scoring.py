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
    if not token_ids:
        return []
    return [None] + chunk_rows(logits, token_ids, 0, k)


def chunk_rows(logits: torch.Tensor, token_ids: list[int], start: int, k: int) -> list[PromptLogprobRow]:
    """Rows for one prefill chunk: ``logits`` ``[c, vocab]`` at prompt positions ``start .. start+c-1``
    score the tokens at ``start+1 .. start+c`` (those inside the prompt). Chunks scored in order
    and concatenated after a leading ``None`` give :func:`prompt_logprob_rows`."""
    n = min(logits.shape[0], len(token_ids) - 1 - start)
    if n <= 0:
        return []
    logp = logits[:n].float().log_softmax(-1)  # prediction for positions start+1 .. start+n
    targets = token_ids[start + 1 : start + 1 + n]
    actual = torch.tensor(targets, device=logp.device)
    actual_lp = logp.gather(1, actual[:, None])  # [n, 1]
    actual_rank = (logp >= actual_lp).sum(-1)  # [n]
    if k > 0:
        top_v, top_i = logp.topk(min(k, logp.shape[-1]), dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    rows: list[PromptLogprobRow] = []
    for j, (tid, lp, rank) in enumerate(zip(targets, actual_lp[:, 0].tolist(), actual_rank.tolist())):
        entries = {tid: ScoredToken(tid, lp, int(rank))}
        if k > 0:  # a top-k entry for the actual token replaces it in place (keeps its first position)
            entries.update((t, ScoredToken(t, v, r + 1)) for r, (t, v) in enumerate(zip(top_i[j], top_v[j])))
        rows.append(list(entries.values()))
    return rows
