"""LoRA rows on the lean forward (kiln.runtime.lean_lora) against PEFT's own mixed-batch forward.

A small Qwen3 with grouped-query attention and projections big enough to be fused and packed,
two LoRA adapters with non-zero B (one on all seven projections, one on q and v only), random
paged KV. Unpacked, the lean forward's logits are bitwise PEFT's for batches of one adapter,
of mixed adapters and of no adapter; packed (fused q|k|v and gate|up), within float rounding.
Adapters it cannot run keep PEFT's forward, and the engine's adapter rows go through it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.runtime.adapter_slots import BASE_KEY
from kiln.runtime.lean_forward import lean_forward_for

from .test_engine_lean import _config, _inputs, _random_pool

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = _config("qwen3").eval()
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ALL), adapter_name="ta")
    pm.add_adapter("tb", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return pm.eval()


def _pair(pm, lean, keys, q_len, keep):
    """(PEFT's logits with per-row ``adapter_names``, the lean forward's) from the same pool state."""
    model = pm.base_model.model
    pool = _random_pool(model)
    table, ids, pos, mask, wb, wo = _inputs(pool, [3, 9, 14, 5][:len(keys)], q_len)
    with torch.inference_mode():
        saved = [t.clone() for t in pool.keys + pool.values]
        ref = pm(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=pool.step(table, wb, wo),
                 use_cache=True, logits_to_keep=keep, adapter_names=list(keys)).logits
        for t, s in zip(pool.keys + pool.values, saved):
            t.copy_(s)
        got = lean(ids, pos, mask, pool.step(table, wb, wo), keep, list(keys))
    return ref, got


BATCHES = [["ta", "ta", "ta"], ["ta", BASE_KEY, "tb", "ta"], ["tb", "tb"], [BASE_KEY, BASE_KEY]]


@pytest.mark.parametrize("q_len", [1, 5])
def test_lora_rows_are_bitwise_pefts_forward(lora_model, q_len):
    lean = lean_forward_for(lora_model.base_model.model, pack=False)
    assert lean is not None and not lean.packed
    for keys in BATCHES:
        assert lean.runs(keys, lora_model.peft_config)
        for keep in (0, 1):
            ref, got = _pair(lora_model, lean, keys, q_len, keep)
            assert torch.equal(ref, got), keys
    # the deltas matter: without the adapters the logits are far from PEFT's
    ref, got = _pair(lora_model, lean, ["ta", "ta", "ta"], q_len, 0)
    base = _pair(lora_model, lean, [BASE_KEY] * 3, q_len, 0)[1]
    assert (ref - base).abs().max().item() > 0.1


def test_lora_rows_on_fused_packed_weights_match_within_rounding(lora_model):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    lean = lean_forward_for(lora_model.base_model.model, pack=True)
    assert lean is not None and lean._fused  # q|k|v and gate|up packed as one weight each
    for keys in BATCHES:
        for q_len in (1, 5):
            ref, got = _pair(lora_model, lean, keys, q_len, 0)
            assert (got - ref).abs().max().item() < 1e-4, keys


def test_adapters_it_cannot_run_keep_pefts_forward(lora_model):
    from peft import LoraConfig

    pm = copy.deepcopy(lora_model)
    lean = lean_forward_for(pm.base_model.model, pack=False)
    assert lean.runs(["ta"], pm.peft_config)
    assert not lean.runs(["ta"], None)  # not wrapped
    assert not lean.runs(["nope"], pm.peft_config)  # unknown key
    for name, cfg in {"dora": LoraConfig(r=2, target_modules=["q_proj"], use_dora=True),
                      "embed": LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]),
                      "head": LoraConfig(r=2, target_modules=["lm_head"]),
                      "bias": LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True)}.items():
        pm.add_adapter(name, cfg)
        assert not lean.runs([name], pm.peft_config), name
        assert not lean.runs(["ta", name], pm.peft_config), name
    pm.train()
    assert not lean.runs(["ta"], pm.peft_config)  # LoRA dropout: training mode keeps PEFT's forward
    assert lean.runs([BASE_KEY], pm.peft_config)
    pm.eval()
    # a key deleted and created again is checked again (its decision is tied to the config object)
    pm.delete_adapter("tb")
    pm.add_adapter("tb", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert not lean.runs(["tb"], pm.peft_config)


def test_engine_adapter_rows_run_on_the_lean_forward(builtin_model_dir, lora_dirs, monkeypatch):
    """The engine's rows with an adapter take the lean forward and decode greedily what PEFT's generate does."""
    from peft import PeftModel

    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.lean_forward import LeanForward
    from kiln.runtime.loader import load_model
    from kiln.runtime.sampling import SamplingParams

    calls: list[list[str]] = []
    real = LeanForward.__call__

    def spy(self, *args, **kwargs):
        calls.append(list(kwargs.get("keys") or (args[5] if len(args) > 5 else None) or []))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LeanForward, "__call__", spy)
    engine = Engine(load_model(builtin_model_dir), EngineConfig(max_running_rows=4, max_model_len=256)).start()
    try:
        assert engine._scheduler.batches.lean is not None
        engine.activate_adapter("tuned", lora_dirs[0], "a" * 64)
        prompt = engine.encode_chat([{"role": "user", "content": "Count: 1 2 3"}])
        out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0), adapter="tuned")[0]
    finally:
        engine.stop()
    key = "tuned@" + "a" * 12
    assert sum(key in keys for keys in calls) >= len(out.token_ids)  # prefill and every decode step
    ref = PeftModel.from_pretrained(load_model(builtin_model_dir).model, lora_dirs[0]).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                do_sample=False)[0, len(prompt):].tolist()
    assert out.token_ids and out.token_ids == expected[: len(out.token_ids)]
