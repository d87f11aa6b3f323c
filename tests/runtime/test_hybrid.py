"""Qwen3.5 hybrids (Gated DeltaNet + full attention) on the built-in engine, with a tiny model built
at test time: loading both published layouts, refusing what the engine cannot run, greedy outputs
equal to transformers' ``generate`` under continuous batching and chunked prefill (in process and
through a real ``kiln serve`` with the openai client, streaming and not), and every per-row state
slot released after finish, cancel and preemption."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import httpx
import pytest
import torch

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.loader import ModelLoadError, load_model
from tests.hybrid_models import build_tiny_hybrid, greedy_rows
from tests.serving.conftest import KILN, free_port, start_server, stop_server

PROMPT_LENGTHS = (5, 17, 40, 3, 33, 70, 8, 51)  # several longer than one 16-token prefill chunk
NEW_TOKENS = 10
CHUNK = 16
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def hybrid_dir(builtin_model_dir, tmp_path_factory):
    return build_tiny_hybrid(tmp_path_factory.mktemp("hybrid"), builtin_model_dir)


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return load_model(hybrid_dir, device="cpu")


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def reference(model, prompt: list[int]) -> list[int]:
    """transformers' own greedy continuation (its cache, its prefill and decode paths), on one thread
    (on a loaded machine its tiny multi-threaded convolutions spend seconds waiting for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
    finally:
        torch.set_num_threads(threads)
    return out[0, len(prompt):].tolist()


def run_concurrently(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    return greedy_rows(engine, batch, NEW_TOKENS, DEADLINE_S)


def wait_released(engine: Engine) -> dict:
    end = time.monotonic() + DEADLINE_S
    while (s := engine.stats())["active_rows"] or s["linear_state_slots_used"] or s["kv_blocks_used"]:
        assert time.monotonic() < end, f"state never released: {s}"
        time.sleep(0.02)
    return s


# -- loading --------------------------------------------------------------------------------------


def test_both_layouts_load_as_the_language_model(hybrid, builtin_model_dir, tmp_path):
    assert hybrid.family.kind == "hybrid" and hybrid.family.language_model_only is False
    assert (hybrid.family.linear_layers, hybrid.family.attention_layers) == (4, 2)
    mm = load_model(build_tiny_hybrid(tmp_path / "mm", builtin_model_dir, multimodal=True), device="cpu")
    assert mm.family.architecture == "Qwen3_5ForConditionalGeneration"
    assert mm.family.loaded_class == "Qwen3_5ForCausalLM" and mm.family.language_model_only is True
    assert not any(n.startswith("model.visual") for n, _ in mm.model.named_parameters())
    ids = torch.tensor([prompts(mm.model.config.vocab_size)[2]])
    from transformers import Qwen3_5ForConditionalGeneration

    full = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "mm")
    with torch.no_grad():
        torch.testing.assert_close(mm.model(ids).logits, full(input_ids=ids).logits)


def sliding_window_model(builtin_model_dir, out):
    """A Qwen3 checkpoint whose layers are sliding-window attention (the paged engine attends fully)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.hybrid_models import TOKENIZER_FILES

    src = json.loads((builtin_model_dir / "config.json").read_text())
    cfg = Qwen3Config(vocab_size=src["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=True,
                      sliding_window=8, max_window_layers=0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (builtin_model_dir / name).is_file():
            (out / name).write_bytes((builtin_model_dir / name).read_bytes())
    return out


def test_unsupported_layer_types_are_refused_at_start_naming_the_architecture(builtin_model_dir, tmp_path):
    model_dir = sliding_window_model(builtin_model_dir, tmp_path / "swa")
    with pytest.raises(ModelLoadError, match="Qwen3ForCausalLM.*sliding_attention"):
        load_model(model_dir, device="cpu")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")} | {"KILN_HOME": str(home)}
    proc = subprocess.run([str(KILN), "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port",
                           str(free_port()), "--no-training"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Qwen3ForCausalLM" in proc.stderr and "sliding_attention" in proc.stderr


# -- the engine -------------------------------------------------------------------------------------


def test_concurrent_chunked_greedy_equals_generate_and_state_is_freed(hybrid):
    batch = prompts(hybrid.model.config.vocab_size)
    want = [reference(hybrid.model, p) for p in batch]
    engine = Engine(hybrid, EngineConfig(prefill_chunk_tokens=CHUNK, token_budget=48, max_model_len=256,
                                         max_running_rows=8)).start()
    try:
        assert engine.prefix_cache == {"requested": True, "effective": True}
        assert engine._scheduler.batches.hybrid is not None  # the lean hybrid forward runs these cycles
        assert run_concurrently(engine, batch) == want
        stats = wait_released(engine)
        assert stats["linear_state_slots_total"] == 8 and stats["linear_state_bytes"] > 0
        assert stats["steps"] < sum(PROMPT_LENGTHS)  # rows really shared cycles
    finally:
        engine.stop()


def test_prefix_cache_restores_the_linear_state_and_greedy_equals_generate(hybrid):
    """8 concurrent prompts sharing a 150-token prefix after one of them ran: each takes the cached
    blocks up to the last state snapshot (position 128) and starts from that state."""
    vocab = hybrid.model.config.vocab_size
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, vocab - 1, (150,), generator=g).tolist()
    batch = [shared + torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in (1, 5, 12, 30, 7, 2, 20, 9)]
    want = [reference(hybrid.model, p) for p in batch]
    engine = Engine(hybrid, EngineConfig(prefill_chunk_tokens=CHUNK * 4, token_budget=96, max_model_len=256,
                                         max_running_rows=8)).start()
    try:
        assert engine.prefix_cache == {"requested": True, "effective": True}
        assert run_concurrently(engine, batch[:1]) == want[:1]  # runs the prefix, snapshots at 64 and 128
        assert run_concurrently(engine, batch) == want
        stats = wait_released(engine)
        assert stats["linear_snapshot_hits"] >= 8 and stats["prefix_cache_hit_blocks"] >= 8 * 128 // 16
    finally:
        engine.stop()


def test_preemption_recomputes_both_states(hybrid):
    """Prompts ending one token short of a block, in a pool of 7 blocks: the first decode steps must
    preempt; the recomputed rows still match generate."""
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, hybrid.model.config.vocab_size - 1, (n,), generator=g).tolist()
             for n in (15, 31, 47, 15, 31, 15)]
    want = [reference(hybrid.model, p) for p in batch]
    probe = Engine(hybrid, EngineConfig(max_model_len=256, max_running_rows=6))
    block = probe._kv.block_nbytes
    reserve = probe.states.nbytes()
    engine = Engine(hybrid, EngineConfig(prefill_chunk_tokens=CHUNK, token_budget=48, max_model_len=256,
                                         max_running_rows=6, kv_block_size=16,
                                         kv_budget_bytes=reserve + 7 * block)).start()
    try:  # a budget that holds the state slots but not the prefix cache's snapshots: the cache is off
        assert engine.prefix_cache == {"requested": True, "effective": False}
        assert run_concurrently(engine, batch) == want
        stats = wait_released(engine)
        assert stats["preemptions"] > 0
    finally:
        engine.stop()


# -- a real server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(hybrid_dir, tmp_path_factory):
    srv = start_server(hybrid_dir, tmp_path_factory.mktemp("hybrid-home"),
                       extra_args=["--no-training", "--max-model-len", "2048", "--prefill-chunk-tokens", str(CHUNK),
                                   "--token-budget", "48"], env_extra={}, config=None)
    yield srv
    assert stop_server(srv) == 0


def health(srv) -> dict:
    return httpx.get(f"{srv.base_url}/health", timeout=10).json()


def wait_idle(srv) -> dict:
    end = time.monotonic() + DEADLINE_S
    while (h := health(srv))["active_rows"] or h["queued_rows"] or h["linear_state"]["slots_used"]:
        assert time.monotonic() < end, f"rows never drained: {h}"
        time.sleep(0.05)
    return h


def test_server_reports_the_family_and_the_effective_prefix_cache(server):
    h = health(server)
    assert h["model_family"]["kind"] == "hybrid" and h["model_family"]["architecture"] == "Qwen3_5ForCausalLM"
    assert h["linear_state"]["slots_used"] == 0 and h["linear_state"]["slots_total"] > 0
    assert h["linear_state"]["snapshots_max"] == 4 * h["linear_state"]["slots_total"]  # the hybrid prefix cache
    kernels = h["linear_state"]["kernels"]  # the CPU: Kiln's lean forward, transformers' on the torch reference
    assert kernels["requested"] == "auto" and kernels["effective"] == "lean-c"
    assert kernels["functions"]["chunk_gated_delta_rule"] == "torch" and kernels["reason"].startswith("cpu: ")
    cards = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    assert cards[0]["model_family"]["linear_attention_layers"] == 4
    eff = httpx.get(f"{server.base_url}/v1/config", timeout=10).json()["effective"]
    assert eff["prefix_cache"] == {"requested": True, "effective": True}  # linear-state snapshots beside blocks


@pytest.mark.parametrize("stream", [False, True])
def test_server_greedy_equals_generate_for_8_concurrent_requests(server, hybrid, stream):
    import openai

    tok = hybrid.tokenizer
    batch = prompts(hybrid.model.config.vocab_size)
    want = [[tok.decode([t]) for t in reference(hybrid.model, p)] for p in batch]

    async def one(client, prompt) -> list[str]:
        kw = dict(model=server.model_id, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})
        if not stream:
            r = await client.completions.create(**kw)
            return r.choices[0].logprobs.tokens
        out: list[str] = []
        async for chunk in await client.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    out.extend(choice.logprobs.tokens)
        return out

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in batch))

    assert asyncio.run(main()) == want
    assert wait_idle(server)["active_rows"] == 0


def test_cancel_mid_stream_frees_rows_and_state_slots(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as c:
            body = {"model": server.model_id, "prompt": list(range(3, 60)), "max_tokens": 400, "stream": True,
                    "ignore_eos": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data:")
                    if seen >= 3:
                        return health(server)

    during = asyncio.run(main())
    assert during["linear_state"]["slots_used"] >= 1  # the row held its slot while streaming
    h = wait_idle(server)
    assert h["active_rows"] == 0 and h["linear_state"]["slots_used"] == 0


def test_server_prompt_logprobs_equal_one_full_forward(server, hybrid):
    """Scoring rows are prefilled in chunks too (different lengths side by side, so in per-length
    groups): every position's logprob equals one unchunked transformers forward's."""
    batch = [p for p in prompts(hybrid.model.config.vocab_size) if len(p) > CHUNK][:3]

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "model": server.model_id, "prompt": p, "max_tokens": 0, "prompt_logprobs": 1}) for p in batch))

    for prompt, r in zip(batch, asyncio.run(main())):
        assert r.status_code == 200, r.text
        rows = r.json()["choices"][0]["prompt_logprobs"]
        with torch.no_grad():
            want = torch.log_softmax(hybrid.model(torch.tensor([prompt])).logits[0].float(), -1)
        assert rows[0] is None and len(rows) == len(prompt)
        got = torch.tensor([rows[i][str(t)]["logprob"] for i, t in enumerate(prompt) if i > 0])
        torch.testing.assert_close(got, want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])],
                                   atol=1e-4, rtol=0)
    assert wait_idle(server)["active_rows"] == 0
