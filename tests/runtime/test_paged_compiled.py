"""The compiled decode step (torch.compile over bucketed static shapes) against the eager reference:
greedy outputs equal. One bucket only (one row, one block wide), so one compilation."""

from __future__ import annotations

from kiln.runtime.batches import bucket
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.sampling import SamplingParams
from tests.runtime.test_engine import loaded  # noqa: F401  (module fixture)

PROMPTS = ["What is the capital of France?", "Count: 1 2 3", "Hi"]


def test_buckets_are_powers_of_two_capped():
    assert [bucket(n, 32) for n in (1, 2, 3, 5, 8, 9, 31, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert bucket(7, 6) == 6


def test_compiled_decode_greedy_equals_eager(loaded):  # noqa: F811
    cfg = dict(max_running_rows=1, max_model_len=64, kv_block_size=64)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = {}
    for compiled in (False, True):
        engine = Engine(loaded, EngineConfig(compile_decode=compiled, **cfg)).start()
        try:
            prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]
            out[compiled] = [engine.generate(p, params, timeout=280)[0].token_ids for p in prompts]
            if compiled:
                state = engine.compile_decode
                if state["effective"]:
                    assert engine._scheduler.batches.compiled_shapes == {(1, 1)}
                else:  # this machine's compiler failed (e.g. ATEN_CPU_CAPABILITY=default): the eager fallback ran
                    assert state["error"] and engine._scheduler.batches.compiled_shapes == set()
            assert engine.stats()["kv_blocks_used"] == 0
        finally:
            engine.stop()
    assert out[True] == out[False]


def test_a_bucket_that_fails_to_compile_turns_the_option_off_not_the_engine(loaded, caplog):  # noqa: F811
    """The compiler's failure on a bucket's first use: that cycle and every later one decode eagerly, the
    engine keeps serving, and ``compile_decode`` says why (no compiler runs: the compiled step is replaced)."""
    cfg = dict(max_running_rows=1, max_model_len=64, kv_block_size=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine(loaded, EngineConfig(**cfg)).start()
    try:
        prompt = engine.encode_chat([{"role": "user", "content": PROMPTS[0]}])
        eager = engine.generate(prompt, params, timeout=120)[0].token_ids
    finally:
        engine.stop()
    engine = Engine(loaded, EngineConfig(compile_decode=True, **cfg)).start()
    calls = []

    def broken(*args):
        calls.append(len(args))
        raise RuntimeError("C++ compile error\nsecond line")

    try:
        engine._scheduler.batches._compiled = broken
        assert engine.compile_decode == {"requested": True, "effective": True, "error": None}
        with caplog.at_level("WARNING", logger="kiln.runtime.batches"):
            out = engine.generate(prompt, params, timeout=120)[0].token_ids
            again = engine.generate(prompt, params, timeout=120)[0].token_ids
        assert out == eager and again == eager
        assert calls == [6]  # tried once, then never again
        assert engine.compile_decode == {"requested": True, "effective": False,
                                         "error": "RuntimeError: C++ compile error"}
        assert any("compile_decode is off" in r.getMessage() for r in caplog.records)
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.stop()
