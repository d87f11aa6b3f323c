"""Training on CUDA: one SFT and one GRPO job on the model's device (bf16 where supported).

Run with ``scripts/test_gpu.sh``; skipped without CUDA. The CPU test below checks the same
contract without a GPU: every batch the loops build is on the device of the trained weights.
"""

from __future__ import annotations

import pytest
import torch

from kiln.training.data import Row, collate
from kiln.training.schemas import GRPOGroup, SFTExample

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def test_collate_builds_batches_on_the_requested_device():
    batch = collate([Row([1, 2, 3], [0, 1, 1]), Row([4], [0])], pad_id=0, device="meta")
    assert {t.device.type for t in batch.values()} == {"meta"}


def _model(builtin_model_dir, device, dtype):
    from peft import get_peft_model

    from kiln.runtime.loader import load_model
    from kiln.training.trainer import lora_config

    lm = load_model(builtin_model_dir, device=device, dtype=dtype)
    return get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle"), lm


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sft_and_grpo_train_on_cuda(builtin_model_dir, dtype):
    from kiln.training.data import tokenize_grpo_group, tokenize_sft
    from kiln.training.templates import end_of_turn_ids
    from kiln.training.trainer import (
        GRPOSettings,
        LearnedCheck,
        Plan,
        add_private_adapter,
        grpo_items,
        lora_config,
        run_grpo,
        run_sft,
    )

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
