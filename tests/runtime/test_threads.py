"""Prompt-only cycles on more torch threads (model.prefill_threads), and bursts gathered while
requests are still being admitted (Engine.admission)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kiln.config import load_settings
from kiln.runtime import scheduler as scheduler_mod
from kiln.runtime.engine import Engine, EngineConfig, prompt_macs_per_token
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.threads import (
    WIDE_PREFILL_MIN_MACS,
    default_threads,
    engine_prefill_threads,
    one_torch_thread,
    pin_torch_threads,
    torch_threads,
    usable_cores,
)
from tests.runtime.test_engine import hf_greedy, loaded, reference  # noqa: F401  (module fixtures)

PROMPT = [{"role": "user", "content": "Tell me about the river and the mountain."}]


@pytest.fixture
def one_thread():
    """The engine thread inherits torch's count when it starts: one thread, as `kiln serve` on 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def recording(engine: Engine) -> list[tuple[str, int, int]]:
    """Wrap the engine's forwards: each call appends (forward, decoding rows, torch threads)."""
    calls: list[tuple[str, int, int]] = []
    b = engine._scheduler.batches
    for name in ("packed", "decode", "prefill"):
        inner = getattr(b, name)

        def wrapped(*args, _inner=inner, _name=name, **kw):
            decoding = len(args[0]) if _name in ("packed", "decode") else 0
            calls.append((_name, decoding, torch.get_num_threads()))
            return _inner(*args, **kw)

        setattr(b, name, wrapped)
    return calls


def test_settings_resolve_the_prefill_threads():
    assert engine_prefill_threads(0, 0) == usable_cores()  # Kiln chooses the layout: every core for prefill
    assert engine_prefill_threads(3, 0) == 0  # the user chose a thread count: kept for every cycle
    assert engine_prefill_threads(1, 4) == 4
    assert default_threads() == max(1, usable_cores() - 1)
    cfg = EngineConfig.from_settings(load_settings(cli={"model.prefill_threads": 3}).settings)
    assert cfg.prefill_threads == 3
    assert EngineConfig.from_settings(load_settings(cli={"model.threads": 2}).settings).prefill_threads == 0


def test_torch_threads_widens_restores_and_never_narrows(one_thread):
    with torch_threads(3) as wide:
        assert wide and torch.get_num_threads() == 3
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError):
        with torch_threads(2):
            raise RuntimeError("a failing forward")
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    with torch_threads(1) as wide:  # fewer than the caller has: left alone
        assert not wide and torch.get_num_threads() == 2


def test_one_torch_thread_narrows_a_wide_cycle_and_restores(one_thread):
    """The lean hybrid's per-row Gated DeltaNet prompt chunks run on one thread inside a wide cycle."""
    with torch_threads(2):
        with pytest.raises(RuntimeError):
            with one_torch_thread():
                assert torch.get_num_threads() == 1
                raise RuntimeError("a failing chunk")
        assert torch.get_num_threads() == 2
    with one_torch_thread():  # already one thread: left alone
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 1


def test_a_pinned_worker_keeps_its_count_through_a_wide_cycle(one_thread):
    """A thread that first uses torch while a cycle is wide would keep the wide count; one that
    pinned its count at start does not (what the trainer and eval workers do)."""
    started, widened, done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def pinned():
        pin_torch_threads()
        started.set()
        widened.wait(10)
        seen["pinned"] = torch.get_num_threads()

    def late():
        seen["late"] = torch.get_num_threads()

    worker = threading.Thread(target=pinned)
    worker.start()
    started.wait(10)
    with torch_threads(2):
        widened.set()
        worker.join(10)
        late_thread = threading.Thread(target=late)
        late_thread.start()
        late_thread.join(10)
    assert seen == {"pinned": 1, "late": 2}  # the unpinned newcomer took the wide count


def test_macs_per_token_leaves_out_the_embedding_tables(loaded):
    model = loaded.model
    total = sum(p.numel() for p in model.parameters())  # tied: the LM head is the input table
    emb = model.get_input_embeddings().weight.numel()
    assert prompt_macs_per_token(model) == total - emb
    assert prompt_macs_per_token(model) * 1000 < WIDE_PREFILL_MIN_MACS  # the built-in model: over 1,000 tokens


def test_prompt_only_cycles_run_wide_and_decode_cycles_do_not(loaded, reference, one_thread, monkeypatch):
    monkeypatch.setattr(scheduler_mod, "WIDE_PREFILL_MIN_MACS", 1.0)  # every prompt-only cycle qualifies
    engine = Engine(loaded, EngineConfig(max_model_len=256, prefill_threads=2)).start()
    calls = recording(engine)
    try:
        prompt = engine.encode_chat(PROMPT)
        out = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), timeout=60)
        stats = engine.stats()
        after = engine.run_job(torch.get_num_threads).result(30)
    finally:
        engine.stop()
    assert out[0].token_ids == hf_greedy(reference, prompt, 6)  # the same greedy tokens on two threads
    prompt_only = [t for name, d, t in calls if d == 0]
    beside_rows = [t for name, d, t in calls if d > 0]
    assert prompt_only == [2]
    assert beside_rows and set(beside_rows) == {1}
    assert after == 1  # the engine thread is back on its own count
    assert stats["prefill_threads"] == 2 and stats["wide_prefill_steps"] == 1
    assert stats["step_cost"]["steps"] == len(beside_rows)  # the fit is of cycles on the engine's own threads


def test_small_prompts_and_mixed_cycles_stay_on_the_engine_threads(loaded, one_thread):
    engine = Engine(loaded, EngineConfig(max_model_len=256, prefill_threads=2)).start()
    calls = recording(engine)
    try:
        prompt = engine.encode_chat(PROMPT)
        engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0), timeout=60)
        stats = engine.stats()
    finally:
        engine.stop()
    assert len(prompt) * prompt_macs_per_token(loaded.model) < WIDE_PREFILL_MIN_MACS
    assert {t for _, _, t in calls} == {1}
    assert stats["wide_prefill_steps"] == 0


def test_no_widening_when_off(loaded, one_thread, monkeypatch):
    monkeypatch.setattr(scheduler_mod, "WIDE_PREFILL_MIN_MACS", 1.0)
    engine = Engine(loaded, EngineConfig(max_model_len=256, prefill_threads=0)).start()
    calls = recording(engine)
    try:
        engine.generate(engine.encode_chat(PROMPT), SamplingParams(max_tokens=3, temperature=0), timeout=60)
        assert engine.stats()["prefill_threads"] is None
    finally:
        engine.stop()
    assert {t for _, _, t in calls} == {1}


# -- bursts gathered across admissions -----------------------------------------------------------------


def burst_of_two(loaded, *, hold_admission: bool) -> tuple[int, int]:
    """Row A is submitted while (optionally) another request's admission is open; B arrives 0.2 s
    later and that admission ends. Returns the engine's cycles before B arrived and in all (both
    rows ask for one token, so a cycle that prefills a prompt also finishes it)."""
    engine = Engine(loaded, EngineConfig(max_model_len=256, burst_gap_s=0.001, burst_max_s=5.0)).start()
    params = [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)]
    try:
        a = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        b = engine.encode_chat([{"role": "user", "content": "Why do people visit Spain?"}])
        admission = engine.admission() if hold_admission else None
        sub_a = engine.submit(a, params)
        time.sleep(0.2)
        before_b = engine.stats()["steps"]
        sub_b = engine.submit(b, params)
        if admission is not None:
            admission.end()
            admission.end()  # idempotent
        deadline = time.monotonic() + 30
        while not (sub_a.finished and sub_b.finished) and time.monotonic() < deadline:
            for s in (sub_a, sub_b):
                s.streams[0].next_chunk_sync(0.1)
        stats = engine.stats()
    finally:
        engine.stop()
    assert sub_a.finished and sub_b.finished
    assert stats["admitting"] == 0 and stats["active_rows"] == 0
    return before_b, stats["steps"]


def test_an_open_admission_holds_the_first_prefill_for_its_request(loaded):
    # A waited for the request being admitted; both prompts shared one cycle
    assert burst_of_two(loaded, hold_admission=True) == (0, 1)


def test_without_an_admission_the_gap_alone_decides(loaded):
    # A ran alone: B came 0.2 s after it, far past burst_gap_s
    assert burst_of_two(loaded, hold_admission=False) == (1, 2)


def test_an_admission_that_never_ends_delays_a_burst_only_burst_max_s(loaded):
    engine = Engine(loaded, EngineConfig(max_model_len=256, burst_max_s=0.05)).start()
    try:
        admission = engine.admission()
        got: list = []
        t = threading.Thread(target=lambda: got.append(engine.generate(
            engine.encode_chat(PROMPT), SamplingParams(max_tokens=2, temperature=0), timeout=30)))
        t.start()
        t.join(30)
        assert got and got[0][0].finish_reason in ("length", "stop")
        assert engine.stats()["admitting"] == 1
        admission.end()
        assert engine.stats()["admitting"] == 0
    finally:
        engine.stop()
