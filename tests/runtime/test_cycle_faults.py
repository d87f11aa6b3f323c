"""Failure classes of the engine cycle (kiln.runtime.cycle_faults): a failing forward fails its rows,
not the engine; out-of-memory shrinks the cycle; only an unknown completion state latches."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from kiln.config import ConfigError
from kiln.runtime.cycle_faults import (
    FAULT_ENV,
    FORWARD_ERROR,
    OUT_OF_MEMORY,
    UNKNOWN_STATE,
    Containment,
    CycleLatched,
    FaultHook,
    InjectedOutOfMemory,
    classify,
    contain,
)
from kiln.runtime.cycle_plan import MIN_OOM_BUDGET, CyclePlan, CyclePlanner
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.loader import load_model
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.submission import EngineNotRunning, EngineOutOfMemory, EngineRowFailed

MARK = "POISON"
DEADLINE_S = 60.0
NEW_TOKENS = 8
QUESTIONS = ["Count: 1 2 3", "What is the capital of France?", "Hi", "Name three colours."]


# -- the pieces, without a model --------------------------------------------------------------------------


def test_classes_of_what_a_forward_raises():
    import torch

    assert classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) == FORWARD_ERROR
    assert classify(ValueError("bad adapter")) == FORWARD_ERROR
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == OUT_OF_MEMORY
    assert classify(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB")) \
        == OUT_OF_MEMORY
    assert classify(MemoryError()) == OUT_OF_MEMORY
    assert classify(InjectedOutOfMemory("x")) == OUT_OF_MEMORY
    assert classify(RuntimeError("CUDA error: device-side assert triggered")) == UNKNOWN_STATE
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered")) == UNKNOWN_STATE


def test_the_hook_reads_its_variable_and_refuses_a_malformed_one(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert FaultHook.from_env(str) is None
    for bad in ("forward_raises", "forward_raises:", "explode:x", ":x"):
        monkeypatch.setenv(FAULT_ENV, bad)
        with pytest.raises(ConfigError, match=FAULT_ENV):
            FaultHook.from_env(str)
    monkeypatch.setenv(FAULT_ENV, "forward_oom:abc")
    hook = FaultHook.from_env(lambda ids: "".join(chr(i) for i in ids))
    assert hook is not None and (hook.kind, hook.marker) == ("forward_oom", "abc")
    hook.before_forward([SimpleNamespace(prompt=[ord(c) for c in "xyz"])])  # no marker: nothing raised
    with pytest.raises(InjectedOutOfMemory):
        hook.before_forward([SimpleNamespace(prompt=[ord(c) for c in "..abc.."])])
    hook.before_update([SimpleNamespace(prompt=[ord(c) for c in "abc"])])  # another kind: nothing raised


def _row(name: str, scoring: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, scoring=scoring)


def _plan(decoding: int, prompts: int, scoring: int = 0) -> CyclePlan:
    return CyclePlan(tuple(_row(f"d{i}") for i in range(decoding)),  # type: ignore[arg-type]
                     tuple((_row(f"p{i}"), 5) for i in range(prompts)),  # type: ignore[arg-type]
                     tuple((_row(f"s{i}", True), 3) for i in range(scoring)))  # type: ignore[arg-type]


def _names(plan: CyclePlan) -> list[str]:
    return [r.name for r in plan.rows]


def test_a_plan_splits_into_rows_or_halves_keeping_each_rows_work():
    plan = _plan(3, 2, 1)
    singles = plan.split(halves=False)
    assert [_names(p) for p in singles] == [["d0"], ["d1"], ["d2"], ["p0"], ["p1"], ["s0"]]
    assert singles[3].prompts[0][1] == 5 and singles[5].scoring[0][1] == 3 and singles[0].decoding
    halves = plan.split(halves=True)
    assert [_names(p) for p in halves] == [["d0", "d1", "d2"], ["p0", "p1", "s0"]]
    assert all(p.threads == 0 for p in halves)


class Recorder:
    """A stand-in scheduler: ``execute`` raises ``exc`` for any plan holding a row named in ``bad``."""

    def __init__(self, bad: set[str], exc: type[Exception] | Exception = RuntimeError("boom"),
                 unsettled: str | None = None):
        self.bad, self.exc = bad, exc
        self.tried: list[list[str]] = []
        self.applied: list[str] = []
        self.failed: dict[str, str] = {}
        self.relieved = 0
        self.how = Containment(self.execute, self.apply, self.fail, self.relieve, unsettled)

    def execute(self, plan):
        self.tried.append(_names(plan))
        if self.bad & set(_names(plan)):
            raise self.exc if isinstance(self.exc, Exception) else self.exc("boom")
        return "out"

    def apply(self, plan, out):
        assert out == "out"
        self.applied.extend(_names(plan))

    def fail(self, row, fault):
        self.failed[row.name] = fault.fault_class

    def relieve(self):
        self.relieved += 1


def test_a_forward_error_reruns_the_rows_one_by_one_and_fails_the_culprit_alone():
    rec = Recorder({"p1"})
    seen = contain(_plan(2, 2), RuntimeError("boom"), rec.how)
    assert rec.failed == {"p1": FORWARD_ERROR}
    assert sorted(rec.applied) == ["d0", "d1", "p0"]
    assert rec.tried == [["d0"], ["d1"], ["p0"], ["p1"]] and rec.relieved == 0
    assert seen == {FORWARD_ERROR: 2}  # the whole cycle, then the culprit alone


def test_out_of_memory_shrinks_the_cycle_by_halves():
    rec = Recorder({"d2"}, InjectedOutOfMemory("out of memory"))
    contain(_plan(4, 0), InjectedOutOfMemory("out of memory"), rec.how)
    assert rec.tried == [["d0", "d1"], ["d2", "d3"], ["d2"], ["d3"]]
    assert rec.failed == {"d2": OUT_OF_MEMORY} and sorted(rec.applied) == ["d0", "d1", "d3"]
    assert rec.relieved == 3  # before each retry: the 4, the 2, then the 1 that ran out


def test_out_of_memory_on_one_prompt_chunk_cuts_the_chunk():
    """A lone 5-token chunk that only fits at 2 tokens runs 2 now (the rest in later cycles); a decode
    token cannot be cut, so a decoding row that runs out of memory alone ends."""
    tried: list[int] = []
    applied: list[int] = []
    failed: list[str] = []

    def execute(plan):
        c = plan.items()[0][1]
        tried.append(c)
        if c > 2:
            raise InjectedOutOfMemory("out of memory")
        return "out"

    how = Containment(execute, lambda plan, out: applied.append(plan.items()[0][1]),
                      lambda row, fault: failed.append(row.name), lambda: None)
    contain(_plan(0, 1), InjectedOutOfMemory("out of memory"), how)
    assert tried == [2] and applied == [2] and failed == []  # 5 -> 2 (5 // 2)
    assert CyclePlan(prompts=((_row("p"), 1),)).shrunk() is None  # type: ignore[arg-type]
    contain(_plan(1, 0), InjectedOutOfMemory("out of memory"), how)
    assert failed == ["d0"]


def test_an_unknown_state_or_an_unsettled_model_latches():
    rec = Recorder(set())
    with pytest.raises(CycleLatched) as info:
        contain(_plan(2, 1), RuntimeError("CUDA error: device-side assert triggered"), rec.how)
    assert info.value.restart.fault_class == UNKNOWN_STATE and "device-side assert" in info.value.restart.reason
    assert rec.tried == [] and rec.failed == {}
    hybrid = Recorder(set(), unsettled="a hybrid's state is updated in place")
    with pytest.raises(CycleLatched) as info:
        contain(_plan(2, 1), RuntimeError("boom"), hybrid.how)
    assert info.value.restart.as_dict() == {"class": UNKNOWN_STATE,
                                            "reason": "a hybrid's state is updated in place: RuntimeError: boom"}


def test_a_failure_in_the_update_of_a_rerun_escapes_uncontained():
    rec = Recorder({"d0"})

    def apply(plan, out):
        raise KeyError("half updated")

    rec.how.apply = apply
    with pytest.raises(KeyError):
        contain(_plan(2, 0), RuntimeError("boom"), rec.how)


def test_out_of_memory_lowers_the_budget_for_a_while_and_halves_it_again():
    planner = CyclePlanner(SimpleNamespace(token_budget=512), None, None, None, None)  # type: ignore[arg-type]
    assert planner.token_budget() == 512
    assert planner.lower_after_oom(_plan(40, 20)) == 70  # (40 + 20 * 5) // 2
    assert planner.token_budget() == 70  # lasting: not only the failed cycle
    assert planner.lower_after_oom(_plan(40, 20)) == 35  # another out-of-memory cycle: halved again
    assert planner.lower_after_oom(_plan(10, 0)) == MIN_OOM_BUDGET  # never under the floor
    planner.oom_budget_until = 0.0  # the hold is over
    assert planner.token_budget() == 512 and planner.oom_budget is None


# -- a real engine with the hook ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(builtin_model_dir):
    return load_model(builtin_model_dir)


def make_engine(loaded, monkeypatch, fault: str | None) -> Engine:
    if fault is None:
        monkeypatch.delenv(FAULT_ENV, raising=False)
    else:
        monkeypatch.setenv(FAULT_ENV, fault)
    return Engine(loaded, EngineConfig(max_model_len=256)).start()


def run_together(engine: Engine, contents: list[str]) -> list[tuple[str, list[int], object]]:
    """Submit one greedy row per content at once; (finish reason, tokens, fault) of each."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    subs = [engine.submit(engine.encode_chat([{"role": "user", "content": c}]), [params]) for c in contents]
    out = []
    for sub in subs:
        stream, reason, fault = sub.streams[0], None, None
        tokens: list[int] = []
        deadline = time.monotonic() + DEADLINE_S
        while reason is None and time.monotonic() < deadline:
            chunk = stream.next_chunk_sync(DEADLINE_S)
            if chunk is not None:
                tokens.extend(t.token_id for t in chunk.tokens)
                reason, fault = chunk.finish_reason, chunk.fault
        out.append((reason, tokens, fault))
    return out


def settled(engine: Engine) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while engine.stats()["active_rows"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()


@pytest.fixture(scope="module")
def clean_tokens(loaded):
    engine = Engine(loaded, EngineConfig(max_model_len=256)).start()
    try:
        return [tokens for _, tokens, _ in run_together(engine, QUESTIONS)]
    finally:
        engine.stop()


@pytest.mark.parametrize(("kind", "cls", "error"), [("forward_raises", FORWARD_ERROR, EngineRowFailed),
                                                   ("forward_oom", OUT_OF_MEMORY, EngineOutOfMemory)])
def test_a_failing_forward_fails_its_row_alone(loaded, monkeypatch, clean_tokens, kind, cls, error):
    engine = make_engine(loaded, monkeypatch, f"{kind}:{MARK}")
    try:
        got = run_together(engine, QUESTIONS[:2] + [f"Say {MARK} twice."] + QUESTIONS[2:])
        reason, tokens, fault = got.pop(2)
        assert reason == "error" and tokens == [] and fault.fault_class == cls
        err = fault.error()
        assert isinstance(err, error) and err.status == (500 if cls == FORWARD_ERROR else 503)
        assert [(r, len(t)) for r, t, _ in got] == [("length", NEW_TOKENS)] * 4
        assert [t for _, t, _ in got] == clean_tokens  # the others' greedy tokens, as in a run without the fault
        stats = settled(engine)
        assert stats["active_rows"] == 0 and stats["kv_blocks_used"] == 0
        assert stats["cycle_faults"].get(cls, 0) >= 2 and stats["restart_required"] is None
        assert engine.health() == (True, None) and engine.restart_required is None
        again = run_together(engine, QUESTIONS[:1])  # still serving
        assert again[0][0] == "length" and again[0][1] == clean_tokens[0]
    finally:
        engine.stop()


def test_a_scoring_row_with_the_marker_fails_alone(loaded, monkeypatch):
    engine = make_engine(loaded, monkeypatch, f"forward_raises:{MARK}")
    try:
        bad = engine.score_prompt(engine.encode_chat([{"role": "user", "content": f"{MARK} {MARK}"}]), 2)
        good = engine.score_prompt(engine.encode_chat([{"role": "user", "content": "Hi"}]), 2)
        assert isinstance(good.result(DEADLINE_S), list)
        with pytest.raises(EngineRowFailed, match="forward_error"):
            bad.result(DEADLINE_S)
        assert engine.health() == (True, None)
    finally:
        engine.stop()


def test_a_failure_in_the_update_latches_with_restart_required(loaded, monkeypatch):
    engine = make_engine(loaded, monkeypatch, f"update_raises:{MARK}")
    try:
        got = run_together(engine, [QUESTIONS[0], f"{MARK}!"])
        assert [r for r, _, _ in got] == ["error", "error"] and all(f is None for _, _, f in got)
        ok, why = engine.health()
        assert not ok and "injected update failure" in why
        assert engine.restart_required["class"] == UNKNOWN_STATE
        assert "injected update failure" in engine.restart_required["reason"]
        assert engine.stats()["restart_required"] == engine.restart_required
        with pytest.raises(EngineNotRunning):
            engine.submit([1, 2, 3], [SamplingParams(max_tokens=2)])
    finally:
        engine.stop()


def test_a_hybrid_model_latches_on_a_failing_forward(builtin_model_dir, tmp_path, monkeypatch):
    from tests.hybrid_models import build_tiny_hybrid

    hybrid = load_model(build_tiny_hybrid(tmp_path, builtin_model_dir), device="cpu")
    engine = make_engine(hybrid, monkeypatch, f"forward_raises:{MARK}")
    try:
        got = run_together(engine, [f"{MARK}?"])
        assert got[0][0] == "error"
        assert engine.restart_required == {"class": UNKNOWN_STATE, "reason": engine.restart_required["reason"]}
        assert "hybrid" in engine.restart_required["reason"] and not engine.health()[0]
    finally:
        engine.stop()


def test_scoring_future_of_an_unrelated_engine_error_stays_generic():
    from kiln.runtime.rows import ScoreRow
    from kiln.runtime.submission import EngineError

    fut: Future = Future()
    ScoreRow([1, 2], 1, "base", fut).end("error")
    with pytest.raises(EngineError) as info:
        fut.result(0)
    assert not isinstance(info.value, EngineRowFailed)


def test_an_out_of_memory_cycle_leaves_a_lower_budget_that_still_serves(loaded, monkeypatch):
    """After forward_oom the engine plans under a lowered token budget (engine stats' token_budget) instead
    of the same size, and a prompt longer than that budget still runs, chunked, to the clean run's tokens."""
    long_prompt = "Repeat after me: " + " ".join(f"word{i}" for i in range(35))
    clean = make_engine(loaded, monkeypatch, None)
    try:
        [(_, want, _)] = run_together(clean, [long_prompt])
        configured = clean.stats()["token_budget"]
    finally:
        clean.stop()
    engine = make_engine(loaded, monkeypatch, f"forward_oom:{MARK}")
    try:
        assert engine.stats()["token_budget"] == configured
        got = run_together(engine, QUESTIONS + [f"Say {MARK}."])
        assert got[-1][0] == "error" and got[-1][2].fault_class == OUT_OF_MEMORY
        stats = settled(engine)
        lowered = stats["token_budget"]
        assert MIN_OOM_BUDGET <= lowered < configured, stats
        assert len(engine.encode_chat([{"role": "user", "content": long_prompt}])) > lowered
        [(reason, tokens, _)] = run_together(engine, [long_prompt])
        assert reason == "length" and tokens == want
        assert engine.stats()["token_budget"] <= lowered and engine.health() == (True, None)
    finally:
        engine.stop()
