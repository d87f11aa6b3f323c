"""Fuzzing the sampler: any parameter the API accepts (and broken logits) gives every row a
valid token, and a row's parameters never change what its greedy neighbours pick."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime.sampling import SamplingParams, make_generator, select_tokens

VOCAB = 37

tiny_floats = st.sampled_from([5e-324, 1e-300, 1e-46, 1e-38, 1e-7, 1e-5, 0.5, 0.999999, 1.0])
temperatures = st.one_of(st.sampled_from([0.0, 1e-6, 1e-5, 2e-5, 0.01, 1.0, 2.0]),
                         st.floats(min_value=0.0, max_value=2.0, allow_nan=False))
top_ps = st.one_of(tiny_floats, st.floats(min_value=5e-324, max_value=1.0, allow_nan=False))
params = st.builds(
    SamplingParams,
    max_tokens=st.just(1),
    temperature=temperatures,
    top_p=top_ps,
    top_k=st.one_of(st.just(0), st.integers(min_value=1, max_value=VOCAB + 5)),
    seed=st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1)),
    logprobs=st.one_of(st.none(), st.integers(min_value=0, max_value=5)),
    presence_penalty=st.one_of(st.just(0.0), st.floats(min_value=-2.0, max_value=2.0)),
    frequency_penalty=st.one_of(st.just(0.0), st.floats(min_value=-2.0, max_value=2.0)),
    repetition_penalty=st.one_of(st.just(1.0), st.sampled_from([1e-6, 0.5, 2.0, 1e6]),
                                 st.floats(min_value=0.01, max_value=2.0)),
    logit_bias=st.lists(st.tuples(st.integers(0, VOCAB - 1), st.floats(min_value=-100, max_value=100)),
                        max_size=4).map(tuple),
    min_p=st.one_of(st.just(0.0), tiny_floats, st.floats(min_value=0.0, max_value=1.0)),
    min_tokens=st.integers(0, 3),
    stop_token_ids=st.frozensets(st.integers(0, VOCAB - 1), max_size=3),
    bad_words=st.lists(st.lists(st.integers(0, VOCAB + 2), min_size=1, max_size=3).map(tuple), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)


class History:
    def __init__(self, prompt, generated, eos_ids=frozenset({VOCAB - 1})):
        self.prompt, self.generated, self.eos_ids = prompt, generated, eos_ids


histories = st.builds(History, st.lists(st.integers(0, VOCAB - 1), max_size=8),
                      st.lists(st.integers(0, VOCAB - 1), max_size=8))
special = st.sampled_from([float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 0.0])


@st.composite
def logit_rows(draw, rows: int) -> torch.Tensor:
    values = draw(st.lists(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32),
                           min_size=rows * VOCAB, max_size=rows * VOCAB))
    t = torch.tensor(values, dtype=torch.float32).view(rows, VOCAB)
    for _ in range(draw(st.integers(0, 6))):  # sprinkle NaN/inf and extreme values
        t[draw(st.integers(0, rows - 1)), draw(st.integers(0, VOCAB - 1))] = draw(special)
    if draw(st.booleans()):  # sometimes a whole row is broken
        t[draw(st.integers(0, rows - 1))] = draw(special)
    return t


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), plist=st.lists(params, min_size=1, max_size=6))
def test_every_row_gets_a_valid_token_and_neighbours_are_unharmed(data, plist):
    """Any accepted parameters, penalties and histories included, and broken logits."""
    rows = len(plist) + 1  # the last row is a clean greedy neighbour
    logits = data.draw(logit_rows(rows))
    neighbour = torch.linspace(-3.0, 3.0, VOCAB)[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))]
    logits[-1] = neighbour
    greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=2)
    allp = plist + [greedy]
    gens = [make_generator(p.seed) for p in allp]
    hist = [data.draw(histories) for _ in plist] + [History([1, 2, 3], [4, 5])]
    before = logits.clone()
    out = select_tokens(logits, allp, gens, torch.Generator().manual_seed(0), hist)
    assert torch.equal(before.nan_to_num(), logits.nan_to_num())  # the caller's logits are not modified
    assert len(out) == rows
    for choice, p in zip(out, allp):
        assert 0 <= choice.token_id < VOCAB
        if p.logprobs is not None:
            assert choice.logprob is not None and math.isfinite(choice.logprob)
            assert all(math.isfinite(lp) for _, lp in choice.top)
    assert out[-1].token_id == int(neighbour.argmax())
    # a row whose finite best token is unique and that keeps only it picks it, whatever the rest
    for row, (choice, p) in enumerate(zip(out[:-1], plist)):
        finite = torch.nan_to_num(logits[row], nan=float("-inf"))
        if p.top_k == 1 and not p.adjusts and p.min_p == 0.0 and torch.isfinite(finite).all() and (finite == finite.max()).sum() == 1:
            assert choice.token_id == int(finite.argmax())


def test_top_p_that_rounds_to_zero_keeps_the_best_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    for top_p in (1e-46, 5e-324):
        picks = {select_tokens(logits, [SamplingParams(max_tokens=1, temperature=2.0, top_p=top_p)],
                               [make_generator(s)])[0].token_id for s in range(20)}
        assert picks == {1}
