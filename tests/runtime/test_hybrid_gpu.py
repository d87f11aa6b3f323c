"""The GPU lane for Qwen3.5 hybrids (kiln.runtime.linear_kernels): flash-linear-attention's and
causal-conv1d's kernels (the ``hybrid-cuda`` extra) against transformers' torch reference, and the
engine's greedy output over them. Skipped without CUDA or without flash-linear-attention (run with
scripts/test_gpu.sh on a machine with the extra installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kiln.runtime import linear_kernels
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.loader import load_model
from tests.hybrid_models import build_tiny_hybrid, greedy_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (hybrid-cuda)"),
]

PROMPT_LENGTHS = (5, 17, 40, 3, 33, 70, 8, 51)
NEW_TOKENS = 10
DEADLINE_S = 120.0
TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2}  # max |logit difference| / max |logit|


@pytest.fixture(scope="module")
def hybrid_dir(builtin_model_dir, tmp_path_factory):
    return build_tiny_hybrid(tmp_path_factory.mktemp("hybrid-gpu"), builtin_model_dir)


@pytest.fixture(autouse=True)
def process_choice(monkeypatch):
    monkeypatch.setitem(linear_kernels._process, "packages", True)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_package_kernels_match_the_torch_reference(hybrid_dir, dtype):
    loaded = load_model(hybrid_dir, device="cuda", dtype=dtype, linear_kernels="auto")
    report = loaded.linear_kernels.describe()
    assert report["functions"]["chunk_gated_delta_rule"] == "fla", report
    ids = torch.tensor([prompts(loaded.model.config.vocab_size)[5]], device="cuda")
    with torch.no_grad():
        fast = loaded.model(ids).logits.float()
        assert linear_kernels.resolve(loaded.model, "cuda", "reference").effective == "reference"
        slow = loaded.model(ids).logits.float()
    assert ((fast - slow).abs().max() / slow.abs().max()).item() < TOLERANCE[dtype]


def test_engine_greedy_on_the_package_kernels_equals_generate_for_8_concurrent_rows(hybrid_dir):
    loaded = load_model(hybrid_dir, device="cuda", dtype="float32", linear_kernels="auto")
    batch = prompts(loaded.model.config.vocab_size)
    want = [greedy(loaded.model, p) for p in batch]
    engine = Engine(loaded, EngineConfig(prefill_chunk_tokens=16, token_budget=48, max_model_len=256,
                                         max_running_rows=8)).start()
    try:
        assert engine.linear_kernels is not None and "fla" in engine.linear_kernels["effective"]
        got = greedy_rows(engine, batch, NEW_TOKENS, DEADLINE_S)
        assert got == want
    finally:
        engine.stop()
