"""Admission by memory, as an operator sees it: each waiting row's queue position and wait in the
engine's stats (``/health``; the HTTP side is checked in test_paged_stress.py), what the head of
the queue waits for; and the KV budget given as a fraction of memory, checked at start-up."""

from __future__ import annotations

import time

import pytest
import torch

from kiln.config import ConfigError, load_settings
from kiln.runtime.engine import Engine, EngineConfig, kv_pool_blocks, memory_total_bytes
from kiln.runtime.loader import load_model
from kiln.runtime.paged_kv import block_bytes, cache_shape
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.submission import Observer
from tests.serving.conftest import start_server, stop_server

BS = 4


@pytest.fixture(scope="module")
def loaded(builtin_model_dir):
    return load_model(builtin_model_dir)


class Waits(Observer):
    def __init__(self):
        self.waits: list[float] = []

    def queue_wait(self, wait_s: float) -> None:
        self.waits.append(wait_s)


def _wait_for(get, ok, what: str, timeout_s: float = 60.0):
    """Poll ``get()`` until ``ok(value)``; returns that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if ok(value):
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_rows_waiting_for_kv_show_positions_and_waits(loaded):
    """Row 1 (100 prompt + 60 output tokens) holds most of a 40-block pool; rows 2 and 3 (80-token
    prompts) cannot get 20 blocks until it ends: they wait, listed in order, blocked on kv_budget."""
    per_block = block_bytes(cache_shape(loaded.model.config), BS, torch.float32)
    obs = Waits()
    engine = Engine(loaded, EngineConfig(kv_block_size=BS, kv_budget_bytes=40 * per_block, prefix_cache=False),
                    observer=obs).start()
    try:
        ids = engine.encode_text(" ".join(["the river and the mountain"] * 60))
        long_prompt, mid_prompt = ids[:100], ids[5:85]
        assert len(long_prompt) == 100 and len(mid_prompt) == 80
        first = engine.submit(long_prompt, [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)],
                              incremental=True)
        first.streams[0].next_chunk_sync(60)  # admitted and decoding
        later = [engine.submit(mid_prompt, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)],
                               incremental=False) for _ in range(2)]
        stats = _wait_for(engine.stats, lambda s: s["queue_blocked_on"] == "kv_budget",
                          "rows 2 and 3 never waited for KV memory")
        assert [q["position"] for q in stats["queue"]] == [1, 2]
        assert [q["prompt_tokens"] for q in stats["queue"]] == [80, 80]
        assert all(q["kind"] == "generate" and q["wait_s"] >= 0 for q in stats["queue"])
        assert stats["queued_rows"] == 2
        first.cancel()
        for sub in later:
            while sub.streams[0].next_chunk_sync(60).finish_reason is None:
                pass
        stats = _wait_for(engine.stats, lambda s: s["active_rows"] == 0, "rows left")
        assert stats["queue"] == [] and stats["queue_blocked_on"] is None and stats["kv_blocks_used"] == 0
        assert len(obs.waits) >= 3  # every admission reports its wait (a preempted row is admitted again)
    finally:
        engine.stop()


def test_running_row_limit_is_named(loaded):
    engine = Engine(loaded, EngineConfig(max_running_rows=1)).start()
    try:
        prompt = engine.encode_chat([{"role": "user", "content": "Hi"}])
        subs = [engine.submit(prompt, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)],
                              incremental=False) for _ in range(3)]
        stats = _wait_for(engine.stats, lambda s: s["queue_blocked_on"] == "running_rows",
                          "the queue never waited for a running-row slot")
        assert 1 <= len(stats["queue"]) <= 2 and stats["queue"][0]["position"] == 1
        for sub in subs:
            sub.cancel()
    finally:
        engine.stop()


def test_kv_budget_fraction_of_memory(loaded):
    shape = cache_shape(loaded.model.config)
    per_block = block_bytes(shape, 16, torch.float32)
    blocks = kv_pool_blocks(EngineConfig(kv_budget_fraction=0.01), shape, torch.float32)
    assert blocks - 1 == int(0.01 * memory_total_bytes("cpu")) // per_block
    with pytest.raises(ConfigError, match="batching.kv_budget_fraction gives a KV budget of"):
        kv_pool_blocks(EngineConfig(kv_budget_fraction=1e-12), shape, torch.float32)
    with pytest.raises(ConfigError, match="batching.kv_budget_bytes gives a KV budget of 1 bytes"):
        kv_pool_blocks(EngineConfig(kv_budget_bytes=1), shape, torch.float32)
    with pytest.raises(ConfigError, match="kv_budget_bytes or batching.kv_budget_fraction, not both"):
        load_settings(cli={"batching.kv_budget_bytes": 1 << 20, "batching.kv_budget_fraction": 0.1})
    with pytest.raises(ConfigError, match="kv_budget_fraction"):
        load_settings(cli={"batching.kv_budget_fraction": 0.95})
    cfg = EngineConfig.from_settings(load_settings(cli={"batching.kv_budget_fraction": 0.25}).settings)
    assert cfg.kv_budget_fraction == 0.25 and cfg.kv_budget_bytes == 0


@pytest.mark.slow  # a kiln serve start-up (the in-process checks above cover the rule itself)
def test_kiln_serve_refuses_a_fraction_too_small_naming_the_key(builtin_model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="batching.kv_budget_fraction gives a KV budget of"):
        srv = start_server(builtin_model_dir, tmp_path, extra_args=["--no-training"],
                           env_extra={"KILN_BATCHING_KV_BUDGET_FRACTION": "1e-12"}, config=None)
        stop_server(srv)
