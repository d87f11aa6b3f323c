"""Probability semantics of a v1 capture row, in plain Python floats.

At one position the teacher distribution P over a vocabulary of size V is stored
sparsely: the selected set S = top-k IDs union forced IDs (each ID once, sorted),
the exact teacher log p_i for every i in S (shape ``[|S|]``), the residual tail
mass p_tail = 1 - sum_{i in S} p_i (one scalar), and the full entropy H(P).
Selected probabilities are never renormalized.

The coarse-tail forward KL treats everything outside S as one bucket; with
S = the whole vocabulary it is exactly the dense forward KL.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from kiln.distill.errors import ProbabilityError

__all__ = [
    "SELECTED_MASS_TOLERANCE",
    "LOGPROB_TOLERANCE",
    "ENTROPY_TOLERANCE",
    "selected_union",
    "residual_tail",
    "check_row_probabilities",
    "log_softmax",
    "sparsify",
    "coarse_tail_forward_kl",
    "dense_forward_kl",
]

# Selected mass may exceed 1 by at most this much (float32 log-probabilities
# summed in float64); the stored tail must match 1 - mass within it too.
SELECTED_MASS_TOLERANCE = 1e-6
# A stored log p may be at most this far above 0 (rounding of a near-certain token).
LOGPROB_TOLERANCE = 1e-6
# Absolute slack on the entropy bounds derived from the selected IDs (nats).
ENTROPY_TOLERANCE = 1e-4


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProbabilityError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _distinct_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ProbabilityError(f"{name} holds {t!r}, outside the vocabulary [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ProbabilityError(f"{name} lists an ID twice")


def selected_union(top_k_ids: Iterable[int], forced_ids: Iterable[int]) -> tuple[int, ...]:
    """S = top-k union forced, sorted ascending, each ID once."""
    return tuple(sorted(set(top_k_ids) | set(forced_ids)))


def residual_tail(selected_logprobs: Sequence[float]) -> float:
    """p_tail = 1 - sum(exp(log p_i)); rounding below zero (within tolerance) reads as 0."""
    mass = math.fsum(math.exp(_finite("log p", lp)) for lp in selected_logprobs)
    if mass > 1.0 + SELECTED_MASS_TOLERANCE:
        raise ProbabilityError(
            f"selected probability mass {mass!r} exceeds 1 by more than {SELECTED_MASS_TOLERANCE}"
        )
    return max(0.0, 1.0 - mass)


def _partial_entropy(logprobs: Iterable[float]) -> float:
    return math.fsum(-math.exp(lp) * lp for lp in logprobs)


def check_row_probabilities(
    *,
    vocab_size: int,
    top_k_ids: Sequence[int],
    forced_ids: Sequence[int],
    selected_ids: Sequence[int],
    selected_logprobs: Sequence[float],
    tail_mass: float,
    entropy: float,
    temperature: float,
) -> None:
    """Raise ``ProbabilityError`` unless one stored position is self-consistent.

    Checks: IDs inside the vocabulary and distinct; S is exactly the sorted union;
    one finite log p <= 0 per selected ID; selected mass <= 1 (within
    ``SELECTED_MASS_TOLERANCE``); stored tail = 1 - mass and non-negative; a full
    vocabulary leaves no tail; a forced-only ID is not likelier than the weakest
    top-k ID; the entropy is finite, non-negative and between the entropy carried
    by S and that plus the largest entropy the tail mass could hold; temperature
    finite and positive.
    """
    _distinct_ids("top_k_ids", top_k_ids, vocab_size)
    _distinct_ids("forced_ids", forced_ids, vocab_size)
    if not top_k_ids:
        raise ProbabilityError("top_k_ids is empty; v1 needs at least one top-k ID")
    if tuple(selected_ids) != selected_union(top_k_ids, forced_ids):
        raise ProbabilityError("selected_ids must be the sorted union of top_k_ids and forced_ids")
    if len(selected_logprobs) != len(selected_ids):
        raise ProbabilityError(
            f"{len(selected_logprobs)} log-probabilities for {len(selected_ids)} selected IDs"
        )
    for i, lp in zip(selected_ids, selected_logprobs):
        if _finite(f"log p of ID {i}", lp) > LOGPROB_TOLERANCE:
            raise ProbabilityError(f"log p of ID {i} is {lp!r}, above 0")
    expected_tail = residual_tail(selected_logprobs)
    tail = _finite("tail_mass", tail_mass)
    if tail < 0:
        raise ProbabilityError(f"tail_mass {tail!r} is negative")
    if abs(tail - expected_tail) > SELECTED_MASS_TOLERANCE:
        raise ProbabilityError(
            f"tail_mass {tail!r} differs from 1 - selected mass = {expected_tail!r}; "
            "selected probabilities must be stored unnormalized"
        )
    rest = vocab_size - len(selected_ids)
    if rest == 0 and tail > SELECTED_MASS_TOLERANCE:
        raise ProbabilityError(f"S covers the whole vocabulary yet tail_mass is {tail!r}")
    lp_of = dict(zip(selected_ids, selected_logprobs))
    weakest_top = min(lp_of[i] for i in top_k_ids)
    for i in forced_ids:
        if i not in top_k_ids and lp_of[i] > weakest_top + LOGPROB_TOLERANCE:
            raise ProbabilityError(f"forced ID {i} outranks the weakest top-k ID; top_k_ids is not the top-k")
    ent = _finite("entropy", entropy)
    if ent < 0:
        raise ProbabilityError(f"entropy {ent!r} is negative")
    low = _partial_entropy(selected_logprobs)
    high = low + (tail * math.log(rest / tail) if tail > 0 and rest > 0 else 0.0)
    if not low - ENTROPY_TOLERANCE <= ent <= high + ENTROPY_TOLERANCE:
        raise ProbabilityError(
            f"entropy {ent!r} is outside [{low!r}, {high!r}] implied by the selected IDs and tail"
        )
    if _finite("temperature", temperature) <= 0:
        raise ProbabilityError(f"temperature must be positive, got {temperature!r}")


def log_softmax(logits: Sequence[float], temperature: float = 1.0) -> list[float]:
    """Dense log-probabilities ``[V]`` from logits ``[V]`` at ``temperature``."""
    t = _finite("temperature", temperature)
    if t <= 0:
        raise ProbabilityError("temperature must be positive")
    scaled = [_finite("logit", x) / t for x in logits]
    top = max(scaled)
    log_z = top + math.log(math.fsum(math.exp(x - top) for x in scaled))
    return [x - log_z for x in scaled]


def sparsify(dense_logprobs: Sequence[float], top_k: int, forced_ids: Sequence[int]) -> dict[str, object]:
    """Reduce a dense distribution ``[V]`` to the v1 stored fields for one position.

    ``top_k_ids`` are ranked by descending probability (lower ID first on ties).
    The tail is exactly 0.0 when S covers the whole vocabulary.
    """
    v = len(dense_logprobs)
    if not 1 <= top_k <= v:
        raise ProbabilityError(f"top_k {top_k} must be in [1, {v}]")
    ranked = sorted(range(v), key=lambda i: (-dense_logprobs[i], i))
    top = tuple(ranked[:top_k])
    forced = tuple(forced_ids)
    sel = selected_union(top, forced)
    logprobs = tuple(float(dense_logprobs[i]) for i in sel)
    # S = the whole vocabulary has no tail by definition; don't store rounding residue.
    tail = 0.0 if len(sel) == v else residual_tail(logprobs)
    return {
        "top_k_ids": top,
        "forced_ids": forced,
        "selected_ids": sel,
        "selected_logprobs": logprobs,
        "tail_mass": tail,
        "entropy": _partial_entropy(dense_logprobs),
    }


def coarse_tail_forward_kl(
    p_logprobs: Sequence[float], p_tail: float, q_logprobs: Sequence[float], q_tail: float
) -> float:
    """D_tail(P || Q) = sum_{i in S} p_i log(p_i / q_i) + p_tail log(p_tail / q_tail).

    ``p_logprobs`` and ``q_logprobs`` have shape ``[|S|]`` over the same selected IDs;
    the tails are scalars. 0 log 0 counts as 0; a positive teacher mass where the
    student has none gives ``math.inf``.
    """
    if len(p_logprobs) != len(q_logprobs):
        raise ProbabilityError(f"P has {len(p_logprobs)} selected IDs, Q has {len(q_logprobs)}")
    p_tail, q_tail = _finite("p_tail", p_tail), _finite("q_tail", q_tail)
    if p_tail < 0 or q_tail < 0:
        raise ProbabilityError("tail masses must be non-negative")
    terms = [
        math.exp(_finite("log p", lp)) * (lp - _finite("log q", lq)) for lp, lq in zip(p_logprobs, q_logprobs)
    ]
    if p_tail > 0:
        if q_tail == 0:
            return math.inf
        terms.append(p_tail * math.log(p_tail / q_tail))
    return math.fsum(terms)


def dense_forward_kl(p_logprobs: Sequence[float], q_logprobs: Sequence[float]) -> float:
    """KL(P || Q) over full distributions ``[V]`` given as log-probabilities."""
    if len(p_logprobs) != len(q_logprobs):
        raise ProbabilityError("dense distributions must have the same vocabulary size")
    return math.fsum(math.exp(lp) * (lp - lq) for lp, lq in zip(p_logprobs, q_logprobs))
