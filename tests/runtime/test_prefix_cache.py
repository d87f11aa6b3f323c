"""Prefix cache: shared, reference-counted prompt blocks; greedy outputs identical with it on and off,
across block boundaries, with adapters, and after eviction."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.loader import load_model
from kiln.runtime.paged_kv import block_bytes, cache_shape
from kiln.runtime.sampling import SamplingParams

SYSTEM = ("You are a careful assistant. Answer briefly, name the sources you use, and say so when you do "
          "not know. Keep the tone friendly and the facts straight. ") * 3
QUESTIONS = ["What is the capital of France?", "Tell me about the river.", "Hi", "Count: 1 2 3"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(builtin_model_dir):
    return load_model(builtin_model_dir)


def chat(engine, q: str) -> list[int]:
    return engine.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])


def run(engine, prompts, adapter=None) -> list[list[int]]:
    return [engine.generate(p, GREEDY, adapter=adapter, timeout=60)[0].token_ids for p in prompts]


def make(loaded, **kw) -> Engine:
    base = dict(token_budget=64, prefill_chunk_tokens=16, max_running_rows=4, max_model_len=512)
    return Engine(loaded, EngineConfig(**(base | kw))).start()


@pytest.mark.parametrize("block_size", [4, 7, 16])
def test_greedy_identical_with_cache_on_and_off_across_block_boundaries(loaded, block_size):
    off = make(loaded, kv_block_size=block_size, prefix_cache=False)
    try:
        prompts = [chat(off, q) for q in QUESTIONS]
        # prompts whose length is, is not, and is one past a multiple of the block size
        head = prompts[0]
        prompts += [head[: block_size * 6], head[: block_size * 6 + 1], head[: block_size * 6 - 1]]
        expected = run(off, prompts)
        assert off.stats()["prefix_cache_hit_blocks"] == 0
    finally:
        off.stop()
    on = make(loaded, kv_block_size=block_size)
    try:
        first = run(on, prompts)
        hits_first = on.stats()["prefix_cache_hit_blocks"]
        second = run(on, prompts)  # everything cached now
        assert first == expected and second == expected
        assert hits_first > 0  # the shared system prompt was reused within the first pass
        assert on.stats()["prefix_cache_hit_blocks"] > hits_first
        assert on.stats()["kv_blocks_used"] == 0 and on.stats()["active_rows"] == 0
    finally:
        on.stop()


def test_cache_survives_eviction_and_stays_exact(loaded):
    bs = 8
    per_block = block_bytes(cache_shape(loaded.model.config), bs, next(loaded.model.parameters()).dtype)
    ref = make(loaded, kv_block_size=bs, prefix_cache=False)
    try:
        prompts = [chat(ref, q) for q in QUESTIONS]
        expected = run(ref, prompts)
    finally:
        ref.stop()
    need = max(-(-(len(p) + GREEDY.max_tokens) // bs) for p in prompts)
    small = make(loaded, kv_block_size=bs, kv_budget_bytes=(need + 2) * per_block)  # room for one row and a bit
    try:
        assert run(small, prompts) == expected
        assert run(small, prompts[::-1]) == expected[::-1]
        stats = small.stats()
        assert stats["prefix_cache_evictions"] > 0 and stats["prefix_cache_hit_blocks"] > 0
        assert stats["kv_blocks_used"] == 0
    finally:
        small.stop()


def test_cache_is_keyed_by_adapter_revision(builtin_model_dir, lora_dirs):
    engine = make(load_model(builtin_model_dir), kv_block_size=8)  # PEFT wraps this copy: keep it private
    plain = make(load_model(builtin_model_dir), kv_block_size=8, prefix_cache=False)
    try:
        prompts = [chat(engine, q) for q in QUESTIONS[:2]]
        plain.activate_adapter("tuned", lora_dirs[0], "a" * 64)
        expected_a = run(plain, prompts, "tuned")
        plain.activate_adapter("tuned", lora_dirs[1], "b" * 64)
        expected_b = run(plain, prompts, "tuned")
        expected_base = run(plain, prompts)
        assert expected_a != expected_base and expected_b != expected_a

        assert run(engine, prompts) == expected_base  # base blocks cached
        engine.activate_adapter("tuned", lora_dirs[0], "a" * 64)
        assert run(engine, prompts, "tuned") == expected_a  # base blocks must not serve the adapter
        assert run(engine, prompts, "tuned") == expected_a  # now from the adapter's own blocks
        engine.activate_adapter("tuned", lora_dirs[1], "b" * 64)
        assert run(engine, prompts, "tuned") == expected_b  # a new revision never reuses the old one's
        assert run(engine, prompts) == expected_base
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.stop()
        plain.stop()


@pytest.mark.parametrize("block_size", [4, 16])
def test_scoring_from_a_position_reuses_the_cached_prompt(loaded, block_size):
    """``score_prompt(..., score_from=s)``: rows before ``s`` are None, the rest are those of a full scoring;
    the prompt's blocks are published and the next scoring of the same prefix starts from them."""
    engine = make(loaded, kv_block_size=block_size)
    try:
        prompt = chat(engine, QUESTIONS[0])
        gen = engine.generate(prompt, GREEDY, timeout=60)[0].token_ids
        s = len(prompt)
        full = engine.score_prompt(prompt + gen, 3).result(60)  # every position, nothing reused or published
        hits = engine.stats()["prefix_cache_hit_blocks"]  # the generation's own prompt published its blocks
        firsts = [engine.score_prompt(prompt + gen, 3, score_from=s).result(60) for _ in range(2)]
        assert engine.stats()["prefix_cache_hit_blocks"] >= hits + 2 * ((s - 1) // block_size)
        for rows in firsts:
            assert len(rows) == len(full) and all(r is None for r in rows[:s])
            for want, got in zip(full[s:], rows[s:]):
                assert [e.token_id for e in got] == [e.token_id for e in want]
                assert [e.rank for e in got] == [e.rank for e in want]
                assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
        # another completion of the same prompt (OPD's samples): the prompt comes from the cache
        hits = engine.stats()["prefix_cache_hit_blocks"]
        other = engine.score_prompt(prompt + gen[::-1], 3, score_from=s).result(60)
        assert engine.stats()["prefix_cache_hit_blocks"] - hits == (s - 1) // block_size
        ref = engine.score_prompt(prompt + gen[::-1], 3).result(60)
        assert [[e.token_id for e in r] for r in other[s:]] == [[e.token_id for e in r] for r in ref[s:]]
        # a prompt only ever scored: the first scoring publishes its blocks, the second reuses them
        lone = engine.encode_chat([{"role": "user", "content": QUESTIONS[3]}]) + gen
        hits = engine.stats()["prefix_cache_hit_blocks"]
        engine.score_prompt(lone, 3, score_from=len(lone) - 1).result(60)
        assert engine.stats()["prefix_cache_hit_blocks"] == hits
        again = engine.score_prompt(lone, 3, score_from=len(lone) - 1).result(60)
        assert engine.stats()["prefix_cache_hit_blocks"] - hits == (len(lone) - 2) // block_size
        assert again[-1] is not None and all(r is None for r in again[:-1])
        assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["active_rows"] == 0
    finally:
        engine.stop()
