"""Model-free storage and runtime estimate for a planned capture.

Pure integer arithmetic over the plan's metadata; it never loads a model or
measures anything. Runtime is reported only from a throughput range the caller
measured earlier; without one both ``seconds_*`` values are ``None``.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.distill.errors import EstimateError

__all__ = [
    "MAX_PLANNED_TOKENS",
    "MAX_VOCAB_SIZE",
    "MAX_TOP_K",
    "MAX_FORCED_IDS",
    "MAX_WIDTH_BYTES",
    "estimate_numbers",
]

MAX_PLANNED_TOKENS = 10**13
MAX_VOCAB_SIZE = 10**7
MAX_TOP_K = MAX_VOCAB_SIZE
MAX_FORCED_IDS = 64
MAX_WIDTH_BYTES = 16


def _count(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise EstimateError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _rate(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EstimateError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise EstimateError(f"{name} must be a finite positive tokens/second figure, got {value!r}")
    return float(value)


def estimate_numbers(
    *,
    tokens: int,
    vocab_size: int,
    top_k: int,
    max_forced: int,
    id_bytes: int,
    logprob_bytes: int,
    tail_bytes: int,
    entropy_bytes: int,
    throughput_min: float | None = None,
    throughput_max: float | None = None,
) -> dict[str, Any]:
    """Return the v1 estimate as a plain dict (the ``Estimate`` model's fields).

    dense_bytes        = N * V * B_logp
    sparse_ids_max     = min(V, K + F)
    sparse_upper_bytes = N * (S_max * (B_id + B_logp) + B_tail + B_entropy)
    seconds_min/max    = N / throughput_max, N / throughput_min (only with a profile)

    Byte counts are exact Python integers with no ceiling beyond what the input
    limits imply (at most 10**13 * 10**7 * 16); a seconds value that would not be
    a finite float is refused with ``EstimateError``.
    """
    n = _count("tokens", tokens, 1, MAX_PLANNED_TOKENS)
    v = _count("vocab_size", vocab_size, 1, MAX_VOCAB_SIZE)
    k = _count("top_k", top_k, 1, MAX_TOP_K)
    f = _count("max_forced", max_forced, 1, MAX_FORCED_IDS)
    if k > v:
        raise EstimateError(f"top_k {k} exceeds vocab_size {v}")
    b_id = _count("id_bytes", id_bytes, 1, MAX_WIDTH_BYTES)
    b_logp = _count("logprob_bytes", logprob_bytes, 1, MAX_WIDTH_BYTES)
    b_tail = _count("tail_bytes", tail_bytes, 1, MAX_WIDTH_BYTES)
    b_ent = _count("entropy_bytes", entropy_bytes, 1, MAX_WIDTH_BYTES)
    if (throughput_min is None) != (throughput_max is None):
        raise EstimateError("give both throughput_min and throughput_max (a measured range) or neither")
    seconds_min = seconds_max = None
    if throughput_min is not None:
        lo, hi = _rate("throughput_min", throughput_min), _rate("throughput_max", throughput_max)
        if lo > hi:
            raise EstimateError(f"throughput_min {lo} is above throughput_max {hi}")
        seconds_min, seconds_max = n / hi, n / lo
        # A positive but tiny rate overflows N / rate to Infinity, which no v1
        # artifact (or CLI output) may hold: refuse instead of writing it.
        if not math.isfinite(seconds_max):
            raise EstimateError(
                f"throughput_min {lo!r} tokens/s is too small: {n} / {lo!r} seconds overflows to Infinity; "
                "give the measured range in tokens per second"
            )
    s_max = min(v, k + f)
    return {
        "dense_bytes": n * v * b_logp,
        "sparse_ids_max": s_max,
        "sparse_upper_bytes": n * (s_max * (b_id + b_logp) + b_tail + b_ent),
        "seconds_min": seconds_min,
        "seconds_max": seconds_max,
        "excludes_metadata": True,
    }
