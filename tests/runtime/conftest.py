"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.loader import load_model


@pytest.fixture(scope="session")
def lora_dirs(builtin_model_dir, tmp_path_factory):
    """Two LoRA adapters with non-zero B, saved with PEFT from independent model copies."""
    from peft import LoraConfig, get_peft_model

    out = []
    for seed in (1, 2):
        base = load_model(builtin_model_dir).model
        peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        d = tmp_path_factory.mktemp(f"lora{seed}")
        peft_model.save_pretrained(d)
        out.append(d)
    return out
