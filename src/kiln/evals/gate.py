"""The post-train gate: rule ``paired_wilson_v1`` as a pure function (standard library only).

Inputs are paired outcomes: for each example of one suite, whether the candidate
passed and whether the baseline passed. The verdict table (docs/evals.md):

=================  ==========================================================================
verdict            condition (checked top to bottom; the first that holds wins)
=================  ==========================================================================
``error``          an evaluation failed, or the two runs do not cover the same examples
``inconclusive``   fewer than ``min_pairs`` paired examples
``regression``     sign test p < alpha and the baseline wins more discordant pairs
``promoted``       sign test p < alpha, the candidate wins more discordant pairs, and the
                   Wilson 95% lower bound of the candidate's accuracy >= ``min_accuracy``
``demoted``        the Wilson lower bound < ``min_accuracy`` (and not a regression)
``kept``           otherwise: the candidate meets ``min_accuracy`` but is not significantly
                   better than the baseline
=================  ==========================================================================

Only ``promoted`` may activate the candidate (and only with ``activate_on_pass``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Sequence

RULE = "paired_wilson_v1"
ALPHA = 0.05
WILSON_Z = 1.959963984540054  # two-sided 95% normal quantile
VERDICTS = ("promoted", "kept", "regression", "demoted", "inconclusive", "error")


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test (binomial, p=0.5) on ``wins + losses`` discordant pairs.

    ``p = min(1, 2 * P[X <= min(wins, losses)])`` with ``X ~ Bin(n, 1/2)``, computed in exact
    rationals; ``1.0`` when there are no discordant pairs. Equal to
    ``scipy.stats.binomtest(wins, n, 0.5).pvalue`` (the distribution is symmetric).
    """
    if wins < 0 or losses < 0:
        raise ValueError("counts must be non-negative")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail))


def wilson_lower(successes: int, n: int, z: float = WILSON_Z) -> float:
    """Wilson score interval lower bound for ``successes`` of ``n`` (0.0 when ``n == 0``)."""
    if n == 0:
        return 0.0
    p = successes / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - margin) / (1 + z2 / n))


@dataclass(frozen=True)
class GateNumbers:
    pairs: int
    candidate_passed: int
    baseline_passed: int
    both_passed: int
    both_failed: int
    candidate_only: int  # discordant: candidate passed, baseline failed
    baseline_only: int  # discordant: baseline passed, candidate failed
    p_value: float
    alpha: float
    candidate_accuracy: float
    baseline_accuracy: float
    wilson_lower: float
    min_accuracy: float
    min_pairs: int


@dataclass(frozen=True)
class GateVerdict:
    rule: str
    verdict: str
    reason: str
    numbers: GateNumbers | None

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "verdict": self.verdict, "reason": self.reason,
                "numbers": None if self.numbers is None else asdict(self.numbers)}


def paired_wilson_v1(pairs: Sequence[tuple[bool, bool]], *, min_accuracy: float, min_pairs: int = 20,
                     alpha: float = ALPHA, error: str | None = None) -> GateVerdict:
    """Apply the rule to ``(candidate_passed, baseline_passed)`` pairs; ``error`` short-circuits."""
    if error is not None:
        return GateVerdict(RULE, "error", error, None)
    n = len(pairs)
    cand = sum(1 for c, _ in pairs if c)
    base = sum(1 for _, b in pairs if b)
    both = sum(1 for c, b in pairs if c and b)
    neither = sum(1 for c, b in pairs if not c and not b)
    c_only = sum(1 for c, b in pairs if c and not b)
    b_only = sum(1 for c, b in pairs if b and not c)
    p = sign_test_p(c_only, b_only)
    low = wilson_lower(cand, n)
    nums = GateNumbers(n, cand, base, both, neither, c_only, b_only, p, alpha,
                       cand / n if n else 0.0, base / n if n else 0.0, low, min_accuracy, min_pairs)
    significant = p < alpha
    if n < min_pairs:
        return GateVerdict(RULE, "inconclusive", f"{n} paired examples, fewer than min_pairs={min_pairs}", nums)
    if significant and b_only > c_only:
        return GateVerdict(RULE, "regression",
                           f"the baseline wins {b_only} of {b_only + c_only} discordant pairs (p={p:.3g} < {alpha})",
                           nums)
    if significant and c_only > b_only and low >= min_accuracy:
        return GateVerdict(RULE, "promoted",
                           f"the candidate wins {c_only} of {b_only + c_only} discordant pairs (p={p:.3g} < {alpha}) "
                           f"and its Wilson lower bound {low:.4f} >= {min_accuracy}", nums)
    if low < min_accuracy:
        return GateVerdict(RULE, "demoted",
                           f"the candidate's Wilson lower bound {low:.4f} < min_accuracy {min_accuracy}", nums)
    return GateVerdict(RULE, "kept",
                       f"no significant difference (p={p:.3g} >= {alpha}); the candidate meets min_accuracy "
                       "but does not beat the baseline", nums)
