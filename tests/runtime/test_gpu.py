"""The engine on CUDA: KV slots, generators and scoring tensors live on the model's device.
Skipped without CUDA (run with scripts/test_gpu.sh)."""

from __future__ import annotations

import httpx
import pytest
import torch

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.loader import load_model
from kiln.runtime.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def cuda_engine(builtin_model_dir):
    engine = Engine(load_model(builtin_model_dir, device="cuda", dtype="float32"),
                    EngineConfig(prefill_chunk_tokens=16, token_budget=64)).start()
    yield engine
    assert engine.stop(30)


def test_engine_state_is_on_the_device(cuda_engine):
    kv = cuda_engine._kv
    assert all(t.is_cuda for t in kv.keys + kv.values)
    assert cuda_engine._scheduler._shared_gen.device.type == "cuda"


def test_generation_on_cuda_with_mixed_sampling(cuda_engine, builtin_model_dir):
    prompt = cuda_engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    params = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.9, seed=11),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-46, top_k=5),
        SamplingParams(max_tokens=12, temperature=0.7, seed=11, logprobs=3),
    ]
    outs = cuda_engine.generate(prompt, params, timeout=DEADLINE_S)
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert outs[1].token_ids[:1] and outs[3].tokens[0].logprob is not None
    again = cuda_engine.generate(prompt, params[1], timeout=DEADLINE_S)[0]
    assert again.token_ids == outs[1].token_ids  # seeded: same draws whoever shares the batch
    ref = load_model(builtin_model_dir, device="cuda", dtype="float32").model
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    exp = expected[0, len(prompt):].tolist()
    assert outs[0].token_ids == exp[: len(outs[0].token_ids)]
    assert cuda_engine.stats()["active_rows"] == 0


def test_chunked_scoring_on_cuda_matches_a_forward(cuda_engine, builtin_model_dir):
    prompt = [(i * 31) % 500 + 3 for i in range(100)]
    rows = cuda_engine.score_prompt(prompt, 3).result(DEADLINE_S)
    ref = load_model(builtin_model_dir, device="cuda", dtype="float32").model
    with torch.no_grad():
        logp = ref(torch.tensor([prompt], device="cuda")).logits[0].float().log_softmax(-1).cpu()
    assert rows[0] is None and len(rows) == len(prompt)
    for i in (1, 16, 17, 99):
        entry = next(e for e in rows[i] if e.token_id == prompt[i])
        assert entry.logprob == pytest.approx(logp[i - 1, prompt[i]].item(), abs=1e-3)


def test_server_on_cuda_serves_and_scores(builtin_model_dir, tmp_path):
    from tests.serving.conftest import start_server, stop_server

    srv = start_server(builtin_model_dir, tmp_path, extra_args=["--no-training", "--device", "cuda"],
                       env_extra={}, config=None)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=DEADLINE_S) as c:
            assert c.get("/health").json()["device"].startswith("cuda")
            chat = c.post("/v1/chat/completions", json={
                "model": srv.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "temperature": 0.8, "seed": 1, "stream": False})
            assert chat.status_code == 200, chat.text
            score = c.post("/v1/completions", json={
                "model": srv.model_id, "prompt": [17, 250, 31, 99], "max_tokens": 1, "prompt_logprobs": 2})
            assert score.status_code == 200, score.text
            assert len(score.json()["choices"][0]["prompt_logprobs"]) == 4
    finally:
        stop_server(srv)
