"""Paged KV: block accounting, admission by memory, preemption and recompute, never out of memory.

Greedy outputs are checked against transformers' own ``generate`` while a tiny KV
budget forces rows to wait for memory and running rows to be preempted.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kiln.runtime.engine import Engine, EngineConfig, PromptTooLong
from kiln.runtime.paged_kv import BlockPool, CacheShape, block_bytes, cache_shape
from kiln.runtime.sampling import SamplingParams
from tests.runtime.test_engine import loaded, reference  # noqa: F401  (module fixtures)

QUESTIONS = [
    "What is the capital of France?",
    "Tell me a long story about the river and the mountain and the sea.",
    "Why do people visit the island?",
    "Count: 1 2 3",
    "Hi",
]


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' model, greedy, ``n`` tokens past any end-of-sequence (as ``ignore_eos``)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.model(ids, use_cache=True)
        past, toks = out.past_key_values, []
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
            out = ref.model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    return toks


def budget(loaded, blocks: int, block_size: int) -> int:
    return blocks * block_bytes(cache_shape(loaded.model.config), block_size, next(loaded.model.parameters()).dtype)


def generate_all(engine, prompts, params):
    out = [None] * len(prompts)

    def work(i):
        out[i] = engine.generate(prompts[i], params, timeout=120)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return out


def test_block_pool_refcounts_cache_and_eviction():
    pool = BlockPool(CacheShape(1, 1, 2), 4, 2, device="cpu", dtype=torch.float32)
    assert pool.capacity == 3 and pool.available() == 3
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (1, 2)  # lowest ids first: touched memory follows the peak in use
    uid = pool.register("base", 0, (5, 6), a)
    assert pool.register("base", 0, (5, 6), b) == uid  # an identical prefix keeps the first block
    pool.release([a, b])
    assert pool.used() == 0 and pool.cached() == 1 and pool.available() == 3
    blocks, last = pool.match("base", [5, 6, 7], 3)
    assert blocks == [a] and last == uid and pool.used() == 1
    assert pool.match("other-adapter", [5, 6, 7], 3) == ([], 0)
    pool.release(blocks)
    got = [pool.allocate() for _ in range(3)]  # the cached block is evicted last
    assert sorted(got) == [1, 2, 3] and pool.cached() == 0 and pool.allocate() is None
    assert pool.match("base", [5, 6, 7], 3) == ([], 0)


def test_gather_reuses_one_buffer_and_matches_index_select():
    pool = BlockPool(CacheShape(2, 3, 4), 8, 2, device="cpu", dtype=torch.float32)
    for t in pool.keys + pool.values:
        t.copy_(torch.randn_like(t))
    big = torch.tensor([3, 1, 5, 2])
    k = pool.gather(0, 1, big)
    assert torch.equal(k, pool.keys[1].index_select(0, big))
    ptr, held = k.data_ptr(), pool.workspace_nbytes()
    assert held == 4 * 2 * 3 * 4 * 4  # one buffer so far: 4 blocks of the keys
    small = torch.tensor([6, 7])
    k2 = pool.gather(0, 0, small)  # the next layer's keys: same buffer, overwritten in place
    assert k2.data_ptr() == ptr and torch.equal(k2, pool.keys[0].index_select(0, small))
    v = pool.gather(1, 0, small)  # values have their own buffer, so k2 stays valid
    assert torch.equal(v, pool.values[0].index_select(0, small)) and torch.equal(k2, pool.keys[0][small])
    assert pool.workspace_nbytes() == held + 2 * 2 * 3 * 4 * 4
    pool.release_workspace()
    assert pool.workspace_nbytes() == 0


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_tiny_budget_waits_and_preempts_with_exact_greedy(loaded, reference, monkeypatch, packed):
    if not packed:
        monkeypatch.setattr("kiln.runtime.batches.PACKED_MAX_SCORES", 0)
    bs = 4
    # 40 blocks of 4 tokens: two or three rows at a time, so rows wait, grow and get preempted
    cfg = EngineConfig(token_budget=32, prefill_chunk_tokens=8, max_running_rows=6, max_model_len=256,
                       kv_block_size=bs, kv_budget_bytes=budget(loaded, 40, bs))
    engine = Engine(loaded, cfg).start()
    try:
        prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        outs = generate_all(engine, prompts, params)
        for p, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(reference, p, 48)
            assert out.finish_reason == "length"
        stats = engine.stats()
        assert stats["preemptions"] > 0
        assert stats["active_rows"] == 0 and stats["queued_rows"] == 0
        assert stats["kv_blocks_used"] == 0  # nothing leaked: every block is free or only cached
        assert stats["kv_blocks_total"] == 40
    finally:
        engine.stop()


def test_request_larger_than_the_budget_is_refused(loaded):
    engine = Engine(loaded, EngineConfig(max_model_len=256, kv_block_size=8,
                                         kv_budget_bytes=budget(loaded, 4, 8))).start()
    try:
        with pytest.raises(PromptTooLong, match="KV budget"):
            engine.submit(list(range(3, 20)), [SamplingParams(max_tokens=40)])
        out = engine.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.stop()


def test_kv_memory_follows_tokens_in_use(loaded):
    """The default pool covers rows x max_model_len, but only blocks in use are held (and counted)."""
    engine = Engine(loaded, EngineConfig(max_running_rows=4, max_model_len=512, kv_block_size=16)).start()
    try:
        assert engine.stats()["kv_blocks_total"] == 4 * 32
        sub = engine.submit([5, 6, 7, 8, 9], [SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)])
        chunk = sub.streams[0].next_chunk_sync(60)
        assert chunk is not None
        used = engine.stats()["kv_blocks_used"]
        assert 1 <= used <= 14  # 5 + 200 tokens need at most 13 blocks of 16, not 32
        assert engine.stats()["kv_workspace_bytes"] > 0  # the gather buffers, while a row runs
        sub.cancel()
        deadline = time.monotonic() + 30
        while engine.stats()["active_rows"] and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.generate([5, 6], SamplingParams(max_tokens=2))  # a cycle after the row ended
        assert engine.stats()["kv_workspace_bytes"] == 0  # freed when no row is left
    finally:
        engine.stop()


def test_settings_reach_the_engine_config():
    from kiln.config import load_settings

    settings = load_settings(cli={"batching.kv_budget_bytes": 1 << 20, "batching.kv_block_size": 8,
                                  "batching.prefix_cache": False}, environ={})
    cfg = EngineConfig.from_settings(settings.settings)
    assert (cfg.kv_budget_bytes, cfg.kv_block_size, cfg.prefix_cache) == (1 << 20, 8, False)


def test_scoring_and_generation_share_a_tiny_budget(loaded, reference):  # noqa: F811
    """Scoring rows wait for memory and may be preempted too; their logprobs stay exact."""
    bs = 4
    cfg = EngineConfig(token_budget=24, prefill_chunk_tokens=8, max_running_rows=4, max_model_len=128,
                       kv_block_size=bs, kv_budget_bytes=budget(loaded, 24, bs))
    engine = Engine(loaded, cfg).start()
    try:
        score_prompts = [[(j * 13 + k) % 400 + 3 for j in range(40)] for k in range(3)]
        gen_prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        futs = [engine.score_prompt(p, 1) for p in score_prompts]
        outs = generate_all(engine, gen_prompts, params)
        for p, out in zip(gen_prompts, outs):
            assert out.token_ids == hf_greedy(reference, p, 32)
        for p, fut in zip(score_prompts, futs):
            rows = fut.result(60)
            with torch.no_grad():
                logp = reference.model(torch.tensor([p])).logits[0].log_softmax(-1)
            assert rows[0] is None and len(rows) == len(p)
            for i in range(1, len(p)):
                entry = next(e for e in rows[i] if e.token_id == p[i])
                assert entry.logprob == pytest.approx(logp[i - 1, p[i]].item(), abs=1e-4)
        deadline = time.monotonic() + 30  # a future resolves just before its row stops counting as active
        while engine.stats()["active_rows"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert stats["active_rows"] == 0 and stats["kv_blocks_used"] == 0
    finally:
        engine.stop()


def test_packed_mixed_step_limit_scales_with_query_channels():
    """The same mixed step is packed for the built-in model's 4 x 32 query channels and split into
    two forwards for a 8 x 64 model, whose dense packed attention costs four times as much."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from kiln.runtime.batches import Batches

    def rows(n: int, blocks: int) -> list:
        return [SimpleNamespace(adapter_key="base", blocks=[1] * blocks) for _ in range(n)]

    decoding, chunks = rows(10, 9), [(r, 150) for r in rows(2, 10)]  # 310 tokens x 12 rows x 160 positions
    verdicts = {}
    for heads, dim in ((4, 32), (8, 64)):
        cfg = Qwen3Config(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=heads, head_dim=dim,
                          num_hidden_layers=1)
        pool = BlockPool(cache_shape(cfg), 64, 16, device="cpu", dtype=torch.float32)
        assert pool.shape.query_channels == heads * dim
        batches = Batches(pool, None, "cpu", 0, lean=False)
        verdicts[heads * dim] = batches.packable(decoding, chunks)
    assert verdicts == {128: True, 512: False}
