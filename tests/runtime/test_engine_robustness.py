"""The engine under abuse: hot-swap during scoring, a stuck step, hostile sampling parameters,
scoring through admission, cancellation and the token budget."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kiln.runtime.engine import Engine, EngineConfig, EngineOverloaded, UnknownAdapter
from kiln.runtime.loader import load_model
from kiln.runtime.sampling import SamplingParams

DEADLINE_S = 60.0


def wait_until(pred, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def settle(engine: Engine) -> None:
    wait_until(lambda: engine.stats()["active_rows"] == 0 and engine.stats()["queued_rows"] == 0, "rows to drain")
    assert engine.stats()["active_rows"] == 0


@pytest.fixture
def private_engine(builtin_model_dir):
    """An engine on its own model copy (adapters wrap the model in PEFT)."""
    engines: list[Engine] = []

    def make(**kw) -> Engine:
        engine = Engine(load_model(builtin_model_dir), EngineConfig(**kw)).start()
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        assert e.stop(30), "engine thread did not stop"


# -- task 1: hot-swap and unload while scoring ------------------------------------------------


def test_scoring_on_adapter_survives_hot_swap_and_unload(private_engine, lora_dirs):
    engine = private_engine(prefill_chunk_tokens=16, token_budget=64)
    prompt = list(range(3, 90))
    engine.activate_adapter("tuned", lora_dirs[0], "a" * 64)
    stop = threading.Event()
    scored = [0]
    errors: list[BaseException] = []

    def score_loop() -> None:
        while not stop.is_set():
            try:
                rows = engine.score_prompt(prompt, 2, adapter="tuned").result(DEADLINE_S)
                assert len(rows) == len(prompt)
                scored[0] += 1
            except UnknownAdapter:
                pass  # unloaded between two requests
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    def swap_loop() -> None:
        for i in range(6):
            engine.activate_adapter("tuned", lora_dirs[i % 2], f"{i:x}" * 64)
            wait_until(lambda: scored[0] > i, "a score between swaps")
        engine.deactivate_adapter("tuned")

    scorers = [threading.Thread(target=score_loop) for _ in range(3)]
    for t in scorers:
        t.start()
    swapper = threading.Thread(target=swap_loop)
    swapper.start()
    swapper.join(DEADLINE_S * 3)
    stop.set()
    for t in scorers:
        t.join(DEADLINE_S)
    assert not swapper.is_alive() and not any(t.is_alive() for t in scorers), "the engine wedged"
    assert not errors, errors
    assert engine.running and engine.health() == (True, None)
    out = engine.generate(prompt[:10], SamplingParams(max_tokens=4, temperature=0), timeout=DEADLINE_S)
    assert out[0].finish_reason in ("length", "stop")
    settle(engine)
    # every retired revision was deleted once its last scoring row ended
    wait_until(lambda: not [k for k in engine.peft_model().peft_config if k.startswith("tuned@")], "retired keys")


def test_many_scorings_then_unload(private_engine, lora_dirs):
    engine = private_engine(prefill_chunk_tokens=256)
    engine.activate_adapter("tuned", lora_dirs[0], "a" * 64)
    prompt = [(i * 13) % 500 + 3 for i in range(1500)]  # long enough to be still running at the unload
    futs = [engine.score_prompt(prompt, 3, adapter="tuned") for _ in range(24)]
    time.sleep(0.3)  # part of the scenario, not an assertion: unload while they run
    engine.deactivate_adapter("tuned")
    for f in futs:
        assert len(f.result(DEADLINE_S)) == len(prompt)
    settle(engine)
    assert engine.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0), timeout=DEADLINE_S)
    wait_until(lambda: not [k for k in engine.peft_model().peft_config if k.startswith("tuned@")], "retired key")


# -- task 1: health and shutdown ----------------------------------------------------------------


def test_health_reports_a_stuck_engine_and_stop_is_bounded(private_engine):
    engine = private_engine(stall_timeout_s=0.2)
    assert engine.health() == (True, None)
    with engine.ownership.exclusive():  # a step that cannot run: the engine waits on shared ownership
        sub = engine.submit([5, 6, 7], [SamplingParams(max_tokens=3, temperature=0)])
        wait_until(lambda: not engine.health()[0], "health to report the stall")
        ok, why = engine.health()
        assert not ok and "stuck" in why
        assert engine.stop(timeout_s=0.2) is False  # gives up instead of waiting forever
    # once the step can run, the thread ends and the row is settled
    assert sub.streams[0].next_chunk_sync(DEADLINE_S) is not None
    wait_until(lambda: engine.stats()["active_rows"] == 0, "rows aborted on stop")


# -- task 4: sampling cannot break the engine --------------------------------------------------


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_vanishing_top_p_with_a_neighbour(private_engine, top_p):
    engine = private_engine()
    prompt = engine.encode_chat([{"role": "user", "content": "Hi"}])
    long = engine.submit(prompt, [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)])
    out = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, top_p=top_p, seed=3),
                          timeout=DEADLINE_S)
    assert out[0].finish_reason in ("length", "stop")
    reasons = []
    while not reasons:
        chunk = long.streams[0].next_chunk_sync(DEADLINE_S)
        if chunk.finish_reason:
            reasons.append(chunk.finish_reason)
    assert reasons == ["length"]
    assert engine.health() == (True, None)
    settle(engine)


def test_failure_in_one_rows_sampling_ends_that_row_only(private_engine, monkeypatch):
    import kiln.runtime.cycle_update as cycle_update

    real = cycle_update.select_tokens

    def flaky(logits, params, gens, shared=None, *rest):
        if any(p.top_k == 7 for p in params):
            raise RuntimeError("sampler blew up")
        return real(logits, params, gens, shared, *rest)

    monkeypatch.setattr(cycle_update, "select_tokens", flaky)
    engine = private_engine()
    good = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    bad = SamplingParams(max_tokens=6, temperature=1.0, top_k=7)
    outs = engine.generate([5, 6, 7, 8], [good, bad, good], timeout=DEADLINE_S)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert engine.running
    settle(engine)


# -- task 5: scoring shares admission, the token budget and cancellation --------------------


def test_scoring_is_admitted_like_generation(private_engine):
    engine = private_engine(max_running_rows=1, max_queued_rows=3, token_budget=16, prefill_chunk_tokens=8)
    with engine.ownership.exclusive():  # hold the engine so nothing leaves the queue
        futs = [engine.score_prompt(list(range(3, 40)), 1) for _ in range(3)]
        with pytest.raises(EngineOverloaded):
            engine.score_prompt([3, 4, 5], 1)
        with pytest.raises(EngineOverloaded):
            engine.submit([3, 4, 5], [SamplingParams(max_tokens=2)])
        assert futs[1].cancel()  # cancelled while queued
    assert len(futs[0].result(DEADLINE_S)) == 37 and len(futs[2].result(DEADLINE_S)) == 37
    settle(engine)


def test_scoring_is_chunked_and_interleaved_with_decode(private_engine, builtin_model_dir):
    engine = private_engine(token_budget=24, prefill_chunk_tokens=8, max_model_len=512)
    prompt = [(i * 37) % 500 + 3 for i in range(480)]
    steps0 = engine.steps
    fut = engine.score_prompt(prompt, 2)
    chat = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                           timeout=DEADLINE_S)
    assert chat[0].finish_reason == "length"
    assert not fut.done(), "the chat waited for the whole scoring prompt"
    rows = fut.result(DEADLINE_S)
    assert engine.steps - steps0 >= len(prompt) // 8  # one chunk per cycle at most
    reference = load_model(builtin_model_dir).model
    with torch.no_grad():
        logp = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert rows[0] is None and len(rows) == len(prompt)
    for i in (1, 8, 9, 200, len(prompt) - 1):
        entry = next(e for e in rows[i] if e.token_id == prompt[i])
        assert entry.logprob == pytest.approx(logp[i - 1, prompt[i]].item(), abs=1e-3)
    settle(engine)


def test_cancelled_scoring_leaves_the_engine(private_engine):
    engine = private_engine(token_budget=8, prefill_chunk_tokens=8, max_model_len=1024)
    fut = engine.score_prompt(list(range(3, 1000)), 1)
    wait_until(lambda: engine.stats()["active_rows"] == 1, "the scoring row to be admitted")
    assert fut.cancel()
    settle(engine)
    assert engine.generate([5, 6], SamplingParams(max_tokens=2, temperature=0), timeout=DEADLINE_S)


def test_a_burst_of_long_scorings_does_not_hold_back_a_chat(private_engine):
    engine = private_engine(max_running_rows=4, max_queued_rows=64, token_budget=512, prefill_chunk_tokens=256)
    prompt = [(i * 11) % 500 + 3 for i in range(1500)]
    futs = [engine.score_prompt(prompt, 1) for _ in range(20)]
    chat = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                           timeout=DEADLINE_S)
    assert chat[0].finish_reason == "length"
    assert sum(f.done() for f in futs) < len(futs) // 2, "the chat waited behind the scoring burst"
    assert all(len(f.result(DEADLINE_S)) == len(prompt) for f in futs)
    settle(engine)
