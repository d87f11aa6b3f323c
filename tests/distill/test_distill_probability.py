"""Top-k/forced union, residual-tail mass, row validation, and the coarse-tail
forward KL (equal to dense forward KL when k = vocabulary size)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.distill.contract import CAPTURE_TOKEN_SCHEMA, CaptureTokenRow
from kiln.distill.errors import ContractError, ProbabilityError
from kiln.distill.probability import (
    check_row_probabilities,
    coarse_tail_forward_kl,
    dense_forward_kl,
    log_softmax,
    residual_tail,
    selected_union,
    sparsify,
)


def test_fixture_rows_hold_mass_point_nine_and_tail_point_one(expert_rows, rollout_rows) -> None:
    for row in [*expert_rows, *rollout_rows]:
        mass = math.fsum(math.exp(lp) for lp in row.selected_logprobs)
        assert mass == pytest.approx(0.9, abs=1e-12)
        assert row.tail_mass == pytest.approx(0.1, abs=1e-12)
        assert len(row.selected_ids) == 2 and row.vocab_size == 3


def test_forced_id_already_in_top_k_is_stored_once() -> None:
    assert selected_union([5, 2, 9], [2]) == (2, 5, 9)
    assert selected_union([5], [7, 1]) == (1, 5, 7)
    dense = log_softmax([3.0, 1.0, 0.0, -1.0])
    stored = sparsify(dense, 2, [1])
    assert stored["top_k_ids"] == (0, 1) and stored["selected_ids"] == (0, 1)
    stored = sparsify(dense, 2, [3])
    assert stored["selected_ids"] == (0, 1, 3)
    assert stored["tail_mass"] == pytest.approx(math.exp(dense[2]), abs=1e-12)


def _row_kwargs(**changes):
    lp = [math.log(0.6), math.log(0.3)]
    base = dict(
        vocab_size=3,
        top_k_ids=[0],
        forced_ids=[1],
        selected_ids=[0, 1],
        selected_logprobs=lp,
        tail_mass=residual_tail(lp),
        entropy=-math.fsum(p * math.log(p) for p in (0.6, 0.3, 0.1)),
        temperature=1.0,
    )
    base.update(changes)
    return base


def test_valid_row_passes() -> None:
    check_row_probabilities(**_row_kwargs())


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"selected_logprobs": [math.nan, math.log(0.3)]}, "finite"),
        ({"selected_logprobs": [-math.inf, math.log(0.3)]}, "finite"),
        ({"selected_logprobs": [math.log(0.8), math.log(0.3)], "tail_mass": 0.0}, "exceeds 1"),
        ({"tail_mass": -0.1}, "negative"),
        ({"tail_mass": 0.0}, "unnormalized"),  # renormalized selection hides the tail
        ({"entropy": -0.01}, "negative"),
        ({"entropy": 5.0}, "outside"),
        ({"entropy": 0.1}, "outside"),
        ({"temperature": 0.0}, "positive"),
        ({"selected_ids": [1, 0]}, "sorted union"),
        ({"forced_ids": [3]}, "outside the vocabulary"),
        ({"top_k_ids": [0, 0]}, "twice"),
        ({"top_k_ids": [1], "forced_ids": [0]}, "outranks"),
        ({"selected_logprobs": [math.log(0.6)]}, "log-probabilities for 2"),
    ],
)
def test_invalid_rows_are_rejected(changes, match) -> None:
    with pytest.raises(ProbabilityError, match=match):
        check_row_probabilities(**_row_kwargs(**changes))


def test_full_vocabulary_leaves_no_tail() -> None:
    lp = [math.log(0.6), math.log(0.3), math.log(0.1)]
    check_row_probabilities(**_row_kwargs(top_k_ids=[0, 1, 2], selected_ids=[0, 1, 2], selected_logprobs=lp,
                                          tail_mass=residual_tail(lp)))
    short = [math.log(0.6), math.log(0.3), math.log(0.05)]
    with pytest.raises(ProbabilityError, match="whole vocabulary"):
        check_row_probabilities(**_row_kwargs(top_k_ids=[0, 1, 2], selected_ids=[0, 1, 2],
                                              selected_logprobs=short, tail_mass=residual_tail(short),
                                              entropy=0.9))


def test_row_model_rejects_invalid_probabilities(expert_rows) -> None:
    obj = expert_rows[0].to_obj()
    with pytest.raises(ContractError, match="tail_mass"):
        CaptureTokenRow.parse(dict(obj, tail_mass=0.2))
    assert obj["schema"] == CAPTURE_TOKEN_SCHEMA


def test_coarse_tail_kl_by_hand() -> None:
    p = [math.log(0.6), math.log(0.3)]
    q = [math.log(0.5), math.log(0.25)]
    expected = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.25) + 0.1 * math.log(0.1 / 0.25)
    assert coarse_tail_forward_kl(p, 0.1, q, 0.25) == pytest.approx(expected, abs=1e-15)
    assert coarse_tail_forward_kl(p, 0.1, q, 0.0) == math.inf
    assert coarse_tail_forward_kl(p, 0.1, p, 0.1) == pytest.approx(0.0, abs=1e-15)


def test_coarse_tail_is_a_lower_bound_of_dense_kl() -> None:
    p = log_softmax([2.0, 1.0, 0.5, -1.0, 0.0])
    q = log_softmax([0.0, 1.5, -0.5, 1.0, 0.3])
    sp = sparsify(p, 2, [])
    ids = sp["selected_ids"]
    q_sel = [q[i] for i in ids]
    d_tail = coarse_tail_forward_kl(sp["selected_logprobs"], sp["tail_mass"], q_sel, residual_tail(q_sel))
    assert 0.0 <= d_tail < dense_forward_kl(p, q)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-8, 8), min_size=2, max_size=12).flatmap(
        lambda a: st.tuples(st.just(a), st.lists(st.floats(-8, 8), min_size=len(a), max_size=len(a)))
    ),
    st.floats(0.25, 4.0),
)
def test_k_equal_to_vocab_is_dense_forward_kl(logits, temperature) -> None:
    p_logits, q_logits = logits
    p = log_softmax(p_logits, temperature)
    q = log_softmax(q_logits, temperature)
    v = len(p)
    stored = sparsify(p, v, [v - 1])
    assert stored["selected_ids"] == tuple(range(v))
    assert stored["tail_mass"] <= 1e-12
    check_row_probabilities(vocab_size=v, temperature=temperature, **stored)
    q_sel = [q[i] for i in stored["selected_ids"]]
    sparse = coarse_tail_forward_kl(stored["selected_logprobs"], stored["tail_mass"], q_sel, residual_tail(q_sel))
    assert sparse == pytest.approx(dense_forward_kl(p, q), abs=1e-9)
