"""Rule paired_wilson_v1: every verdict from a constructed outcome table, statistics against
scipy.stats.binomtest and a hand-written Wilson formula."""

from __future__ import annotations

import math

import pytest

from kiln.evals.gate import ALPHA, VERDICTS, paired_wilson_v1, sign_test_p, wilson_lower

scipy_stats = pytest.importorskip("scipy.stats")


def table(both: int, cand_only: int, base_only: int, neither: int) -> list[tuple[bool, bool]]:
    """(candidate_passed, baseline_passed) pairs with the given cell counts."""
    return ([(True, True)] * both + [(True, False)] * cand_only + [(False, True)] * base_only
            + [(False, False)] * neither)


def hand_wilson(k: int, n: int) -> float:
    z = 1.959963984540054
    phat = k / n
    return (phat + z * z / (2 * n) - z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n))) / (1 + z * z / n)


def check_numbers(v, both, cand_only, base_only, neither):
    n = both + cand_only + base_only + neither
    nums = v.numbers
    assert nums.pairs == n
    assert (nums.both_passed, nums.candidate_only, nums.baseline_only, nums.both_failed) == \
        (both, cand_only, base_only, neither)
    assert nums.candidate_passed == both + cand_only and nums.baseline_passed == both + base_only
    disc = cand_only + base_only
    want_p = 1.0 if disc == 0 else scipy_stats.binomtest(cand_only, disc, 0.5, alternative="two-sided").pvalue
    assert nums.p_value == pytest.approx(want_p, rel=1e-12, abs=1e-15)
    assert nums.wilson_lower == pytest.approx(hand_wilson(both + cand_only, n), rel=1e-12)
    assert nums.candidate_accuracy == pytest.approx((both + cand_only) / n)


@pytest.mark.parametrize("cells,min_acc,verdict", [
    # promoted: candidate wins 12-0 discordant (p = 2/4096), 22/25 right, Wilson low ~0.70 >= 0.6
    ((10, 12, 0, 3), 0.6, "promoted"),
    # regression: baseline wins 10-1 (p ~ 0.0117 < 0.05)
    ((8, 1, 10, 6), 0.0, "regression"),
    # demoted: significantly better (9-0) but the Wilson low bound (~0.50) is under 0.8
    ((4, 9, 0, 12), 0.8, "demoted"),
    # demoted without significance: 3-2 discordant, 5/25 right
    ((2, 3, 2, 18), 0.5, "demoted"),
    # kept: 20/25 right (Wilson low ~0.61 >= 0.5), 2-1 discordant is not significant
    ((18, 2, 1, 4), 0.5, "kept"),
    # inconclusive: 19 pairs < min_pairs 20, even with a perfect candidate
    ((0, 19, 0, 0), 0.5, "inconclusive"),
])
def test_each_verdict_from_a_table(cells, min_acc, verdict):
    v = paired_wilson_v1(table(*cells), min_accuracy=min_acc, min_pairs=20)
    assert v.verdict == verdict, v.reason
    check_numbers(v, *cells)


def test_error_verdict_has_no_numbers():
    v = paired_wilson_v1(table(20, 0, 0, 0), min_accuracy=0.5, error="the candidate run failed")
    assert v.verdict == "error" and v.numbers is None and "failed" in v.reason
    assert v.as_dict()["numbers"] is None


def test_table_rows_cover_every_verdict():
    assert set(VERDICTS) == {"promoted", "kept", "regression", "demoted", "inconclusive", "error"}


def test_boundaries():
    # p exactly at the 6-0 boundary: 2/64 = 0.03125 < 0.05 -> significant; 5-0: 0.0625 -> not.
    assert sign_test_p(6, 0) == pytest.approx(0.03125) and sign_test_p(6, 0) < ALPHA
    assert sign_test_p(5, 0) == pytest.approx(0.0625)
    v5 = paired_wilson_v1(table(15, 5, 0, 0), min_accuracy=0.5)
    assert v5.verdict == "kept"
    v6 = paired_wilson_v1(table(14, 6, 0, 0), min_accuracy=0.5)
    assert v6.verdict == "promoted"
    # a regression wins over the accuracy floor: the baseline is significantly better even if both are low
    assert paired_wilson_v1(table(0, 0, 8, 12), min_accuracy=0.9).verdict == "regression"
    # min_accuracy met exactly counts (>=)
    low = wilson_lower(20, 20)
    assert paired_wilson_v1(table(0, 20, 0, 0), min_accuracy=low).verdict == "promoted"


@pytest.mark.parametrize("wins,losses", [(w, l) for w in range(0, 26, 3) for l in range(0, 26, 4)])
def test_sign_test_matches_scipy(wins, losses):
    n = wins + losses
    want = 1.0 if n == 0 else scipy_stats.binomtest(wins, n, 0.5).pvalue
    assert sign_test_p(wins, losses) == pytest.approx(want, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (0, 20), (7, 20), (20, 20), (50, 120), (999, 1000)])
def test_wilson_matches_hand_formula(k, n):
    assert wilson_lower(k, n) == pytest.approx(max(0.0, hand_wilson(k, n)), rel=1e-12, abs=1e-15)
    assert 0.0 <= wilson_lower(k, n) <= k / n
