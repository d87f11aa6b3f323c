"""The step-cost fit and the limit it puts on prompt tokens beside decoding rows (batching.mixed_step_factor)."""

from __future__ import annotations

import threading

import pytest

from kiln.config import ConfigError, load_settings
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.sampling import SamplingParams
from kiln.runtime import cycle_plan
from kiln.runtime.cycle_plan import MIN_MIXED_PROMPT_TOKENS
from kiln.runtime.step_cost import StepCost
from tests.runtime.test_engine import hf_greedy, loaded, reference  # noqa: F401  (module fixtures)

# -- the fit -------------------------------------------------------------------------------------


def test_fit_recovers_an_affine_cost_and_answers_the_allowance():
    cost = StepCost()
    for n in [1, 8, 30, 8, 8, 120, 3, 8] * 4:
        cost.observe(n, 0.002 + 0.0005 * n)
    a, b = cost.fit()
    assert a == pytest.approx(0.002, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)
    assert cost.predict(100) == pytest.approx(0.052, rel=1e-6)
    # a step of 8 decode tokens costs 6 ms; 1.5x that leaves 3 ms, 6 tokens of 0.5 ms
    assert cost.extra_tokens(8, 1.5) == 6
    assert cost.extra_tokens(8, 1.0) == 0
    snap = cost.snapshot()
    assert snap == {"fixed_ms": 2.0, "per_token_ms": 0.5, "steps": 32}


def test_no_answer_until_step_sizes_differ_and_none_for_a_flat_cost():
    cost = StepCost()
    assert cost.fit() is None and cost.extra_tokens(8, 1.5) is None and cost.predict(8) is None
    for _ in range(50):  # only decode steps of one size: the slope cannot be separated from the fixed part
        cost.observe(8, 0.006)
    assert cost.fit() is None and cost.extra_tokens(8, 1.5) is None
    flat = StepCost()
    for n in (1, 50, 1, 50, 1, 50):  # every step costs the same: no limit, not a huge or negative count
        flat.observe(n, 0.004)
    assert flat.fit()[1] == pytest.approx(0.0, abs=1e-12)
    assert flat.extra_tokens(1, 1.5) is None
    flat.observe(0, 1.0)
    flat.observe(5, 0.0)  # empty or unmeasured steps are not observations
    assert flat.steps == 6


def test_the_fit_follows_a_change_of_cost():
    cost = StepCost(forget=0.9)
    for n in [1, 40] * 20:
        cost.observe(n, 0.001 + 0.0001 * n)
    for n in [1, 40] * 40:  # an adapter batch, a longer context, another tenant: 4x the per-token cost
        cost.observe(n, 0.001 + 0.0004 * n)
    assert cost.fit()[1] == pytest.approx(0.0004, rel=0.05)


def test_forget_must_be_a_fraction():
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="forget"):
            StepCost(forget=bad)


def test_setting_is_validated_and_reaches_the_engine():
    with pytest.raises(ConfigError, match="mixed_step_factor is a factor >= 1"):
        load_settings(cli={"batching.mixed_step_factor": 0.5})
    assert EngineConfig.from_settings(load_settings(cli={}).settings).mixed_step_factor == 1.5
    cfg = EngineConfig.from_settings(load_settings(cli={"batching.mixed_step_factor": 0}).settings)
    assert cfg.mixed_step_factor == 0.0


# -- the scheduler under a known cost ----------------------------------------------------------------


class FixedCost(StepCost):
    """A fit that does not move: 1 ms a step plus 0.25 ms a token."""

    def observe(self, tokens: int, seconds: float) -> None:
        self.steps += 1

    def fit(self):
        return 0.001, 0.00025


LONG = ("Tell me a long story about the river and the mountain and the sea, the forest and the city, "
        "and the island beyond them all.")


def run_joining(loaded, factor: float) -> tuple[list[tuple[int, int]], list[int], list[int], list[int], Engine]:
    """Row A decodes; a long prompt B arrives while it does. Returns every cycle's (decoding rows,
    prompt tokens), A's and B's greedy tokens, B's prompt, and the stopped engine."""
    engine = Engine(loaded, EngineConfig(max_model_len=512, prefill_chunk_tokens=256,
                                         mixed_step_factor=factor)).start()
    sched = engine._scheduler
    sched.step_cost = FixedCost()
    cycles: list[tuple[int, int]] = []
    plan = sched.planner.plan

    def recording_plan():
        planned = plan()
        cycles.append((len(planned.decoding), sum(c for _, c in planned.prompts + planned.scoring)))
        return planned

    sched.planner.plan = recording_plan
    try:
        a_prompt = engine.encode_chat([{"role": "user", "content": "Count: 1 2 3"}])
        b_prompt = engine.encode_chat([{"role": "user", "content": LONG}])
        # A decodes long enough to still be decoding while B's prompt is spread over mixed cycles (4 tokens a
        # cycle here), however far A got before B's thread submitted it (48 tokens were too few on a loaded CI)
        a_sub = engine.submit(a_prompt, [SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)])
        first = a_sub.streams[0].next_chunk_sync(30)  # A is decoding before B arrives
        assert first is not None
        got: dict[str, list[int]] = {}
        b_thread = threading.Thread(target=lambda: got.setdefault(
            "b", engine.generate(b_prompt, SamplingParams(max_tokens=8, temperature=0), timeout=60)[0].token_ids))
        b_thread.start()
        b_thread.join(60)
        while not a_sub.finished:
            a_sub.streams[0].next_chunk_sync(30)
        a_tokens = list(a_sub._rows[0].generated)
        assert engine.stats()["active_rows"] == 0
    finally:
        engine.stop()
    return cycles, a_tokens, got["b"], b_prompt, engine


def test_prompt_beside_decoding_rows_is_spread_to_the_allowance(loaded, reference, monkeypatch):
    monkeypatch.setattr(cycle_plan, "MIXED_AGE_CYCLES", 10**9)  # FixedCost's cycles are shorter than real ones
    cycles, a_tokens, b_tokens, b_prompt, engine = run_joining(loaded, 1.5)
    assert len(b_prompt) > 3 * MIN_MIXED_PROMPT_TOKENS
    mixed = [(d, t) for d, t in cycles if d > 0 and t > 0]
    cost = FixedCost()
    for d, t in mixed:  # 1 decoding row: 1.25 ms a step, half of it is 2 tokens -> the floor of 4
        assert t <= max(MIN_MIXED_PROMPT_TOKENS, cost.extra_tokens(d, 1.5))
    assert sum(t for _, t in mixed) >= len(b_prompt) - MIN_MIXED_PROMPT_TOKENS  # B was prefilled beside A
    assert len(mixed) >= 3
    # chunking changes no output: both rows still match transformers' generate
    assert b_tokens == hf_greedy(reference, b_prompt, 8)[: len(b_tokens)]
    assert engine.stats()["step_cost"]["per_token_ms"] == 0.25


def test_the_allowance_grows_with_the_age_of_a_held_back_prompt(loaded, monkeypatch):
    # every real cycle outlasts many of FixedCost's predicted 1.25 ms decode cycles: with one age
    # step per 1e-6 of them the allowance is many times the prompt by the time B is planned, so
    # the cycle takes the whole prompt, as with the factor off
    monkeypatch.setattr(cycle_plan, "MIXED_AGE_CYCLES", 1e-6)
    cycles, _, _, b_prompt, _ = run_joining(loaded, 1.5)
    mixed = [t for d, t in cycles if d > 0 and t > 0]
    assert mixed and max(mixed) == len(b_prompt)


def test_factor_zero_prefills_the_joining_prompt_at_once(loaded):
    cycles, _, _, b_prompt, _ = run_joining(loaded, 0.0)
    mixed = [t for d, t in cycles if d > 0 and t > 0]
    assert mixed and max(mixed) == len(b_prompt)


def test_the_engine_fits_its_own_steps(loaded):
    engine = Engine(loaded, EngineConfig(max_model_len=256)).start()
    try:
        prompt = engine.encode_chat([{"role": "user", "content": LONG}])
        engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        snap = engine.stats()["step_cost"]
    finally:
        engine.stop()
    # one prefill step of the whole prompt and 11 decode steps of one token: sizes differ, so a fit exists
    assert snap["steps"] >= 12
    assert snap["per_token_ms"] is not None and snap["fixed_ms"] is not None
