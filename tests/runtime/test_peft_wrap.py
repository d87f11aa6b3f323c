"""Wrapping a model with PEFT prints nothing to the operator (kiln.runtime.peft_wrap): the pinned PEFT reads a
property transformers 5 deprecated, and every `kiln serve` printed that FutureWarning at its first adapter."""

from __future__ import annotations

import warnings

import pytest


def _tiny():
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=64)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def _future(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]


def test_wrap_is_quiet_and_other_future_warnings_still_show():
    import peft

    from kiln.runtime.peft_wrap import get_peft_model

    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], lora_dropout=0.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peft.get_peft_model(_tiny(), config)
    if not any("is_gradient_checkpointing" in m for m in _future(seen)):
        pytest.skip("this PEFT no longer reads the deprecated property: kiln.runtime.peft_wrap can go")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrapped = get_peft_model(_tiny(), config, adapter_name="a")
        warnings.warn("another deprecation", FutureWarning)
    assert _future(seen) == ["another deprecation"]
    assert "a" in wrapped.peft_config
