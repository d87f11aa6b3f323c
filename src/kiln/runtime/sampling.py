"""Per-row sampling parameters and batched next-token selection.

One decode step produces logits ``[rows, vocab]`` for every running row; this
module turns them into one token per row. Greedy rows (``temperature == 0``)
take the argmax; sampled rows go through temperature, top-k and top-p in one
batched pass, then each seeded row draws with its own ``torch.Generator`` so a
seeded request gives the same tokens whoever shares its batch. Logprobs are
those of the model's raw distribution (log-softmax of the logits), as vLLM
reports them by default.

Before that, rows that ask for them get logit adjustments, in vLLM's order:
bad words and ``min_tokens`` (end tokens impossible until the row has that many
tokens) as masks, ``logit_bias`` added, then the repetition penalty (prompt and
output tokens, as transformers' ``RepetitionPenaltyLogitsProcessor``), the
frequency and presence penalties (output tokens only, as OpenAI defines them);
``min_p`` filters sampled rows after temperature (as ``MinPLogitsWarper``); last, a
row's grammar constraint (structured output) masks every token it forbids, and
once the tokens are picked it is told them (:mod:`kiln.runtime.constrained`
computes the next masks while the next forward runs). Rows
that ask for none of these cost nothing extra, and a row's adjustments never
touch its batch-mates. The per-row history comes from ``rows`` (objects with
``prompt``, ``generated`` and ``eos_ids``: the scheduler's rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy
LOGPROB_FLOOR = -9999.0  # reported for impossible tokens, as vLLM does
SAFE_SCALED_LOGIT = 1e30  # |logit| / temperature below this: plain scaling stays finite in float32


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 1 discourages any token seen in prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_p: float = 0.0  # sampled rows keep tokens with p >= min_p * p(best)
    min_tokens: int = 0  # end tokens (eos, stop_token_ids) impossible before this many tokens
    stop_token_ids: frozenset[int] = frozenset()  # generating one ends the row ("stop")
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    # this row's grammar state (kiln.runtime.constrained.RowConstraint): masks the row's logits
    # to the tokens the grammar allows next; one object per row, never shared
    constraint: Any = field(default=None, compare=False)
    adjusts: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "adjusts", bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.min_tokens or self.bad_words or self.constraint is not None))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class TokenChoice:
    """The token picked for one row, with its logprob info when asked for."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


def _filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p for sampled rows; ``logits``: ``[m, vocab]`` -> probabilities ``[m, vocab]``.

    Robust to any parameter the API accepts and to broken logits: NaN logits count as
    impossible, the best token always survives top-k/top-p (a ``top_p`` that rounds to 0
    in float32 keeps just it), scaling happens after subtracting each row's maximum so a
    tiny temperature cannot overflow, and a row with no possible token at all (every logit
    NaN or -inf) draws token 0. Every returned row is a valid distribution.
    """
    temps = [max(p.temperature, GREEDY_EPS) for p in params]
    t = torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
    peak = float(logits.abs().max())  # NaN or inf when any logit is
    possible = None
    if peak / min(temps) < SAFE_SCALED_LOGIT:  # the common case: finite, and scaling cannot overflow
        logits = logits / t
    else:
        logits = _sanitize(logits)
        best = logits.max(-1, keepdim=True).values  # -inf only for a row with no possible token
        possible = torch.isfinite(best)
        logits = (logits - best) / t  # the best token at 0: a tiny temperature cannot overflow
    vocab = logits.shape[-1]
    min_p_drop = None
    if any(p.min_p > 0.0 for p in params):
        # min_p is relative to the best token, so it is the same before or after top-k/top-p renormalize
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0.0 else float("-inf") for p in params],
                                 dtype=logits.dtype, device=logits.device)[:, None]
        min_p_drop = logits < logits.max(-1, keepdim=True).values + log_min_p
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    need_k = any(k < vocab for k in top_ks)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            ks = torch.tensor(top_ks, device=logits.device)
            drop |= torch.arange(vocab, device=logits.device)[None, :] >= ks[:, None]
        if need_p:
            top_ps = torch.tensor([min(max(p.top_p, 0.0), 1.0) for p in params], dtype=logits.dtype,
                                  device=logits.device)
            probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            cum = probs_sorted.cumsum(-1)
            # keep the smallest prefix whose mass reaches top_p
            drop |= (cum - probs_sorted) >= top_ps[:, None]
        drop[:, 0] = False  # the best token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if min_p_drop is not None:  # never drops a row's best token (it is at the row's maximum)
        logits = logits.masked_fill(min_p_drop, float("-inf"))
    probs = logits.softmax(-1)
    # the best token survives every filter, so a row with a finite best is a valid distribution
    if possible is not None and not bool(possible.all()):
        onehot = torch.zeros_like(probs)
        onehot[:, 0] = 1.0
        probs = torch.where(possible, probs, onehot)
    return probs


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (impossible), +inf -> the largest float (certain, and arithmetic stays finite)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def _end_ids(params: SamplingParams, row: Any) -> list[int]:
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(getattr(row, "eos_ids", ()))
    return sorted(ids)


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[Any] | None) -> torch.Tensor:
    """The logits after each row's masks, bias and penalties; ``logits``: ``[rows, vocab]`` float.

    Returns ``logits`` itself when no row adjusts, else a copy with only the adjusting
    rows changed. ``rows[i]`` supplies ``prompt``, ``generated`` (token ids) and
    ``eos_ids``; without ``rows`` the history is empty.
    """
    which = [i for i, p in enumerate(params) if p.adjusts]
    if not which:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    dev = out.device
    constrained: list[tuple[int, Any, list[int]]] = []
    for i in which:
        p = params[i]
        row = rows[i] if rows is not None else None
        generated = getattr(row, "generated", None) or []  # read, not copied: this runs every step
        x = out[i]
        if p.bad_words:
            banned = [w[-1] for w in p.bad_words
                      if 0 <= w[-1] < vocab and (len(w) == 1 or list(generated[len(generated) - len(w) + 1:]) == list(w[:-1]))]
            if banned:
                x[torch.tensor(banned, device=dev)] = float("-inf")
        if p.min_tokens and len(generated) < p.min_tokens:
            ends = [t for t in _end_ids(p, row) if 0 <= t < vocab]
            if ends:
                x[torch.tensor(ends, device=dev)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if 0 <= t < vocab], device=dev, dtype=torch.long)
            vals = torch.tensor([b for t, b in p.logit_bias if 0 <= t < vocab], device=dev, dtype=out.dtype)
            x.index_add_(0, ids, vals)
        if p.repetition_penalty != 1.0:
            seen = [t for t in [*(getattr(row, "prompt", None) or ()), *generated] if 0 <= t < vocab]
            if seen:
                idx = torch.tensor(sorted(set(seen)), device=dev, dtype=torch.long)
                v = x[idx]
                x[idx] = torch.where(v < 0, v * p.repetition_penalty, v / p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and generated:
            gen = torch.tensor([t for t in generated if 0 <= t < vocab], device=dev, dtype=torch.long)
            counts = torch.bincount(gen, minlength=vocab).to(out.dtype)
            x -= counts * p.frequency_penalty + (counts > 0).to(out.dtype) * p.presence_penalty
        if p.constraint is not None:
            constrained.append((i, p.constraint, generated))
    # last, all rows of a kind at once (grammars, thinking budgets): penalties cannot revive a token they forbid
    for kind, items in _by_kind(constrained, 1).items():
        kind.mask_rows(out, items)
    return out


def select_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
    rows: Sequence[Any] | None = None,
) -> list[TokenChoice]:
    """Pick one token per row. ``logits``: ``[rows, vocab]`` (any float dtype); ``rows`` gives each
    row's history for penalties and ``min_tokens`` (see :func:`adjust_logits`)."""
    raw = logits = logits.float()  # NaN logits may win a greedy argmax: still a valid token
    logits = adjust_logits(logits, params, rows)
    n = logits.shape[0]
    chosen = torch.empty(n, dtype=torch.long, device=logits.device)
    greedy_idx = [i for i, p in enumerate(params) if p.greedy]
    sampled_idx = [i for i, p in enumerate(params) if not p.greedy]
    if greedy_idx:
        if len(greedy_idx) == n:
            chosen = logits.argmax(-1)
        else:
            gi = torch.tensor(greedy_idx, device=logits.device)
            chosen[gi] = logits[gi].argmax(-1)
    if sampled_idx:
        si = torch.tensor(sampled_idx, device=logits.device)
        probs = _filter_logits(logits[si], [params[i] for i in sampled_idx])
        unseeded = [j for j, i in enumerate(sampled_idx) if generators[i] is None]
        if unseeded:
            uj = torch.tensor(unseeded, device=logits.device)
            draws = torch.multinomial(probs[uj], 1, generator=shared_generator).squeeze(1)
            chosen[si[uj]] = draws
        for j, i in enumerate(sampled_idx):
            gen = generators[i]
            if gen is not None:
                chosen[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    ids = chosen.tolist()
    out = [TokenChoice(t) for t in ids]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        wi = torch.tensor(want, device=logits.device)
        # -inf (and NaN from a broken row) become vLLM's -9999.0: JSON has no infinities
        logp = torch.nan_to_num(raw[wi].log_softmax(-1), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
        picked = logp.gather(1, chosen[wi][:, None]).squeeze(1).tolist()
        kmax = max(params[i].logprobs or 0 for i in want)
        top = logp.topk(kmax, dim=-1) if kmax > 0 else None
        for j, i in enumerate(want):
            out[i].logprob = picked[j]
            k = params[i].logprobs or 0
            if k and top is not None:
                top_v, top_i = top
                out[i].top = list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()))
    advance = [(p.constraint, ids[i]) for i, p in enumerate(params) if p.constraint is not None]
    # constrained rows: consume the picked tokens (grammars prepare their next masks off this thread)
    for kind, items in _by_kind(advance, 0).items():
        kind.advance_rows(items)
    return out


def _by_kind(items: list[tuple], at: int) -> dict[Any, list[tuple]]:
    """``items`` grouped by the type of their constraint (``item[at]``), order kept within each group."""
    groups: dict[Any, list[tuple]] = {}
    for item in items:
        groups.setdefault(type(item[at]), []).append(item)
    return groups


def make_generator(seed: int | None, device: str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
