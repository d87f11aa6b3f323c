"""The batching engine in process: exactness against transformers, chunked prefill, cancellation, adapters."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kiln.runtime.engine import AdapterError, Engine, EngineConfig, EngineOverloaded, PromptTooLong, UnknownAdapter
from kiln.runtime.loader import load_model
from kiln.runtime.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "What is 3 + 4?",
    "Tell me a long story about the river and the mountain and the sea.",
    "Hi",
    "What is the capital of Spain? Answer in one word, please, and be brief about it.",
    "Count: 1 2 3",
]


@pytest.fixture(scope="module")
def loaded(builtin_model_dir):
    return load_model(builtin_model_dir)


@pytest.fixture(scope="module")
def reference(builtin_model_dir):
    """An independent copy of the model for transformers' own generate."""
    return load_model(builtin_model_dir)


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def make_engine(loaded, **kw) -> Engine:
    return Engine(loaded, EngineConfig(**kw)).start()


def run_concurrently(fn, args_list):
    results = [None] * len(args_list)

    def work(i, a):
        results[i] = fn(*a)

    threads = [threading.Thread(target=work, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_greedy_equals_generate_with_chunked_prefill_and_queueing(loaded, reference, monkeypatch, packed):
    # tiny budget and chunks: prompts are split over several cycles, rows wait for the 3 slots
    if not packed:  # force the two-forward path (batched decode + right-padded prefill)
        monkeypatch.setattr("kiln.runtime.batches.PACKED_MAX_SCORES", 0)
    engine = make_engine(loaded, token_budget=24, prefill_chunk_tokens=7, max_running_rows=3, max_model_len=256)
    try:
        prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        assert max(len(p) for p in prompts) > 2 * 7
        params = SamplingParams(max_tokens=24, temperature=0)
        outs = run_concurrently(lambda p: engine.generate(p, params, timeout=60)[0], [(p,) for p in prompts])
        for p, out in zip(prompts, outs):
            expected = hf_greedy(reference, p, 24)
            assert out.token_ids == expected[: len(out.token_ids)]
            assert out.finish_reason == ("length" if len(out.token_ids) == 24 else "stop")
        stats = engine.stats()
        assert stats["active_rows"] == 0
        assert stats["cycle_s"] > 0  # the generation cadence the trainer sizes its holds from (hold_cycles)
    finally:
        engine.stop()


def test_seeded_sampling_ignores_batch_mates(loaded):
    engine = make_engine(loaded)
    try:
        prompt = engine.encode_chat([{"role": "user", "content": QUESTIONS[2]}])
        seeded = SamplingParams(max_tokens=20, temperature=1.8, top_k=50, seed=1234)
        alone = engine.generate(prompt, seeded)[0].token_ids
        noisy = SamplingParams(max_tokens=30, temperature=1.5)
        jobs = [(prompt, seeded)] + [(engine.encode_chat([{"role": "user", "content": q}]), noisy) for q in QUESTIONS]
        crowded = run_concurrently(lambda p, s: engine.generate(p, s)[0].token_ids, jobs)
        assert crowded[0] == alone
        other_seed = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=1.8, top_k=50, seed=99))
        assert other_seed[0].token_ids != alone
    finally:
        engine.stop()


def test_cancel_frees_row_and_engine_keeps_serving(loaded, reference):
    engine = make_engine(loaded, max_running_rows=4, max_model_len=512)
    try:
        long_params = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
        prompt = engine.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
        subs = [engine.submit(prompt, [long_params]) for _ in range(3)]
        first = subs[1].streams[0].next_chunk_sync(30)
        assert first is not None and first.tokens
        assert engine.stats()["active_rows"] == 3
        subs[1].cancel()
        subs[0].cancel()
        deadline = time.monotonic() + 10
        while engine.stats()["active_rows"] > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["active_rows"] == 1
        reason = None
        while reason is None:
            reason = subs[0].streams[0].next_chunk_sync(10).finish_reason
        assert reason == "abort"
        # the survivor was compacted into a new slot: it and a fresh request stay exact
        fresh = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
        assert fresh.token_ids == hf_greedy(reference, prompt, 16)[: len(fresh.token_ids)]
        subs[2].cancel()
        while engine.stats()["active_rows"]:
            time.sleep(0.01)
    finally:
        engine.stop()


def test_admission_errors(loaded):
    engine = make_engine(loaded, max_queued_rows=2, max_model_len=64)
    try:
        with pytest.raises(PromptTooLong):
            engine.submit(list(range(5, 70)), [SamplingParams(max_tokens=1)])
        with pytest.raises(PromptTooLong):
            engine.submit([5, 6], [SamplingParams(max_tokens=63)])
        with pytest.raises(EngineOverloaded):
            engine.submit([5, 6], [SamplingParams(max_tokens=4)] * 3)
        with pytest.raises(UnknownAdapter):
            engine.submit([5, 6], [SamplingParams(max_tokens=4)], adapter="missing")
    finally:
        engine.stop()


def test_stop_sequences_and_eos(loaded):
    engine = make_engine(loaded)
    try:
        prompt = engine.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
        full = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0))[0]
        assert full.finish_reason == "stop" and full.token_ids[-1] in engine.tokens.eos_ids
        stop = full.text[5:9]
        cut = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=(stop,)))[0]
        assert cut.text == full.text[: full.text.index(stop)]
        assert cut.finish_reason == "stop"
    finally:
        engine.stop()


def test_prompt_scoring_matches_forward(loaded, reference):
    engine = make_engine(loaded)
    try:
        prompt = [17, 250, 31, 99, 4]
        rows = engine.score_prompt(prompt, 3).result(30)
        with torch.no_grad():
            logp = reference.model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert rows[0] is None
        for i in range(1, len(prompt)):
            entries = {e.token_id: e for e in rows[i]}
            assert prompt[i] in entries
            assert set(logp[i - 1].topk(3).indices.tolist()) <= set(entries)
            for tid, e in entries.items():
                assert e.logprob == pytest.approx(logp[i - 1, tid].item(), abs=1e-4)
    finally:
        engine.stop()


# -- adapters -------------------------------------------------------------------------------


def peft_greedy(builtin_model_dir, adapter_dir, prompt, n):
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_model(builtin_model_dir).model, adapter_dir).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_adapters_mixed_batch_and_hot_swap(builtin_model_dir, lora_dirs, reference):
    loaded = load_model(builtin_model_dir)  # this engine wraps its model in PEFT: keep it private
    engine = make_engine(loaded)
    try:
        prompt = engine.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
        n = 16
        exp_base = hf_greedy(reference, prompt, n)
        exp_a = peft_greedy(builtin_model_dir, lora_dirs[0], prompt, n)
        exp_b = peft_greedy(builtin_model_dir, lora_dirs[1], prompt, n)
        assert exp_a != exp_base and exp_b != exp_a

        engine.activate_adapter("tuned", lora_dirs[0], "a" * 64)
        assert engine.active_adapters() == {"tuned": "a" * 64}
        greedy = SamplingParams(max_tokens=n, temperature=0)
        jobs = [(None,), ("tuned",), (None,), ("tuned",)]
        outs = run_concurrently(lambda a: engine.generate(prompt, greedy, adapter=a)[0].token_ids, jobs)
        for (adapter,), out in zip(jobs, outs):
            expected = exp_a if adapter else exp_base
            assert out == expected[: len(out)], adapter

        # a row admitted before the swap keeps its revision; new rows get the new one
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        old = engine.submit(prompt, [long], adapter="tuned")
        assert old.adapter_revision == "a" * 64
        engine.activate_adapter("tuned", lora_dirs[1], "b" * 64)
        new = engine.generate(prompt, greedy, adapter="tuned")[0].token_ids
        assert new == exp_b[: len(new)]
        toks = []
        while True:
            chunk = old.streams[0].next_chunk_sync(60)
            toks.extend(t.token_id for t in chunk.tokens)
            if chunk.finish_reason:
                break
        assert toks[:n] == exp_a[:n] or toks[: len(exp_a)] == exp_a
        assert "tuned@" + "a" * 12 not in engine.peft_model().peft_config  # deleted once its last row ended

        # a failed activation leaves the previous revision serving
        with pytest.raises(AdapterError):
            engine.activate_adapter("tuned", lora_dirs[0].parent / "does-not-exist", "c" * 64)
        assert engine.active_adapters() == {"tuned": "b" * 64}

        engine.deactivate_adapter("tuned")
        assert engine.active_adapters() == {}
        with pytest.raises(UnknownAdapter):
            engine.generate(prompt, greedy, adapter="tuned")
        base_after = engine.generate(prompt, greedy)[0].token_ids
        assert base_after == exp_base[: len(base_after)]
    finally:
        engine.stop()
