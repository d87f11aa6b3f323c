"""Per-row sampling parameters and batched next-token selection.

One decode step produces logits ``[rows, vocab]`` for every running row; this
module turns them into one token per row. Greedy rows (``temperature == 0``)
take the argmax; sampled rows go through temperature, top-k and top-p in one
batched pass, then each seeded row draws with its own ``torch.Generator`` so a
seeded request gives the same tokens whoever shares its batch. Logprobs are
those of the model's raw distribution (log-softmax of the logits), as vLLM
reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def select_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
) -> list[TokenChoice]:
    """Pick one token per row. ``logits``: ``[rows, vocab]`` (any float dtype)."""
    logits = logits.float()  # NaN logits may win a greedy argmax: still a valid token
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
        logp = torch.nan_to_num(logits[wi].log_softmax(-1), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
        picked = logp.gather(1, chosen[wi][:, None]).squeeze(1).tolist()
        kmax = max(params[i].logprobs or 0 for i in want)
        top_v, top_i = (logp.topk(kmax, dim=-1) if kmax > 0 else (None, None))
        for j, i in enumerate(want):
            out[i].logprob = picked[j]
            k = params[i].logprobs or 0
            if k:
                out[i].top = list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()))
    return out


def make_generator(seed: int | None, device: str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
