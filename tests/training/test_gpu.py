"""Training on CUDA: one SFT and one GRPO job on the model's device (bf16 where supported).

Run with ``scripts/test_gpu.sh``; skipped without CUDA. The CPU test below checks the same
contract without a GPU: every batch the loops build is on the device of the trained weights.
"""

from __future__ import annotations

import pytest
import torch

from kiln.training.core.data import Row, collate
from kiln.training.schemas import GRPOGroup, SFTExample

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def test_collate_builds_batches_on_the_requested_device():
    batch = collate([Row([1, 2, 3], [0, 1, 1]), Row([4], [0])], pad_id=0, device="meta")
    assert {t.device.type for t in batch.values()} == {"meta"}


def _model(builtin_model_dir, device, dtype):
    from peft import get_peft_model

    from kiln.runtime.loader import load_model
    from kiln.training.core.lora import lora_config

    lm = load_model(builtin_model_dir, device=device, dtype=dtype)
    return get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle"), lm


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sft_and_grpo_train_on_cuda(builtin_model_dir, dtype):
    from kiln.training.core.data import tokenize_grpo_group, tokenize_sft
    from kiln.training.core.loop import LearnedCheck, Plan
    from kiln.training.core.lora import add_private_adapter, lora_config
    from kiln.training.core.templates import end_of_turn_ids
    from kiln.training.grpo.job import run_grpo
    from kiln.training.grpo.step import GRPOSettings, grpo_items
    from kiln.training.sft.job import run_sft

    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    peft_model, lm = _model(builtin_model_dir, "cuda", dtype)
    tok = lm.tokenizer
    ex = SFTExample.model_validate({"messages": [{"role": "user", "content": "How many legs does an ant have?"},
                                                 {"role": "assistant", "content": "An ant has six legs."}]})
    rows = tokenize_sft(tok, [ex], max_seq_len=256, end_ids=end_of_turn_ids(tok, lm.model.generation_config))
    params = add_private_adapter(peft_model, "sft", lora_config(16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                 seed=0)
    assert params[0].device.type == "cuda"
    report = run_sft(peft_model, "sft", rows, Plan(1e-2, 200, 8, 0, max_steps=200, until_learned=LearnedCheck()),
                     pad_id=tok.pad_token_id)
    assert report.extra["learned"] is True and report.steps <= 200

    group = GRPOGroup.model_validate({"messages": [{"role": "user", "content": "Pick"}],
                                      "completions": [{"text": "blue", "reward": 1}, {"text": "red", "reward": 0}]})
    items, skipped = grpo_items([tokenize_grpo_group(tok, group, max_seq_len=256)], [[1.0, 0.0]],
                                scale_rewards=True)
    add_private_adapter(peft_model, "grpo", lora_config(8, 16, ["q_proj", "v_proj"]), seed=0)
    report = run_grpo(peft_model, "grpo", items, Plan(1e-3, 3, 8, 0), GRPOSettings(kl_coef=0.1), pad_id=tok.pad_token_id,
                      skipped_groups=skipped)
    assert report.steps == 3 and report.final_loss == report.final_loss  # finite, not NaN


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_nccl_processes_train_the_adapter_one_process_trains(tmp_path, builtin_model_dir, sharding):
    """torchrun with 2 processes on 2 GPUs (NCCL), DDP or FSDP, against one process on one GPU.

    float32 so that the comparison measures the distribution, not bf16 rounding; CUDA reductions are
    not bitwise deterministic, so the bound is 1e-4 here (1e-5 on CPU, tests/training/test_distributed.py).
    """
    import json
    import subprocess
    import sys

    from tests.training.test_distributed import REQUEST, RUN_TIMEOUT_S, _env, _max_abs_diff, _torchrun, _weights

    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST | {"epochs": 8, "max_steps": 16}))
    env = _env(builtin_model_dir) | {"KILN_MODEL_DEVICE": "auto", "KILN_MODEL_DTYPE": "float32"}
    one = subprocess.run([sys.executable, "-m", "kiln.training.run", "--home", str(tmp_path / "one"),
                          "--request", str(request)], capture_output=True, text=True, env=env,
                         timeout=RUN_TIMEOUT_S, check=False)
    assert one.returncode == 0, one.stderr[-3000:]
    extra = ["--fsdp"] if sharding == "fsdp" else []
    two = _torchrun(2, ["--home", str(tmp_path / "two"), "--request", str(request), *extra], env)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (one, two))
    assert b["world_size"] == 2 and a["report"]["steps"] == b["report"]["steps"] == 16
    assert _max_abs_diff(_weights(a), _weights(b)) <= 1e-4
