"""The engine's lean forward (kiln.runtime.lean_forward) against transformers' own module forward.

A small Qwen3 with grouped-query attention (4 query heads over 2 KV heads) and Linear
weights big enough to be packed for oneDNN, random weights, built in memory. Both
forwards read and write the same paged KV pool through the same block tables. The
packed path's fused q|k|v and gate|up weights are checked on Qwen3, Qwen2 (q/k/v
biases) and Llama (all attention biases) configs, under a PEFT wrap, with a fused
weight missing, and through the engine's greedy decoding against transformers' generate.
"""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.lean_forward import PACK_MIN_ELEMENTS, lean_forward_for
from kiln.runtime.paged_kv import BlockPool, cache_shape


@pytest.fixture(scope="module")
def gqa_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    assert model.model.layers[0].mlp.up_proj.weight.numel() >= PACK_MIN_ELEMENTS
    return model


def _inputs(pool: BlockPool, lengths: list[int], q_len: int):
    """Block tables for rows holding ``lengths`` positions, writing the next ``q_len`` positions."""
    bs = pool.block_size
    tables = [[pool.allocate() for _ in range(pool.blocks_for(n + q_len))] for n in lengths]
    table = pool.table(tables)
    pos = torch.tensor([[n + j for j in range(q_len)] for n in lengths])
    rows = torch.arange(len(lengths))[:, None]
    wb, wo = table[rows, pos // bs], pos % bs
    kv_len = table.shape[1] * bs
    mask = (torch.arange(kv_len)[None, None, :] <= pos[:, :, None])[:, None]
    ids = torch.randint(0, 512, (len(lengths), q_len))
    return table, ids, pos, mask, wb, wo


def _random_pool(model) -> BlockPool:
    pool = BlockPool(cache_shape(model.config), 32, 4, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        for t in pool.keys + pool.values:
            t.normal_()
    return pool


def _both(model, lean, pool, table, ids, pos, mask, wb, wo, keep):
    """(transformers' logits, lean logits) from the same pool state."""
    with torch.inference_mode():
        saved = [t.clone() for t in pool.keys + pool.values]
        ref = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=pool.step(table, wb, wo),
                    use_cache=True, logits_to_keep=keep).logits
        for t, s in zip(pool.keys + pool.values, saved):
            t.copy_(s)
        got = lean(ids, pos, mask, pool.step(table, wb, wo), keep)
    return ref, got


@pytest.mark.parametrize("q_len", [1, 5])  # decode (packed GQA queries) and a prompt chunk (repeated KV heads)
def test_lean_forward_is_bitwise_the_module_forward(gqa_model, q_len):
    lean = lean_forward_for(gqa_model, pack=False)
    assert lean is not None and not lean.packed
    pool = _random_pool(gqa_model)
    table, ids, pos, mask, wb, wo = _inputs(pool, [3, 9, 14], q_len)
    ref, got = _both(gqa_model, lean, pool, table, ids, pos, mask, wb, wo, 1)
    assert ref.shape == got.shape == (3, 1, 512)
    assert torch.equal(ref, got)
    keep = torch.tensor([[q_len - 1], [0], [q_len - 1]])  # per-row positions, as prefill asks for them
    ref, got = _both(gqa_model, lean, pool, table, ids, pos, mask, wb, wo, keep)
    assert torch.equal(ref, got)


def test_packed_weights_match_within_rounding(gqa_model):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    lean = lean_forward_for(gqa_model, pack=True)
    assert lean is not None and lean.packed
    pool = _random_pool(gqa_model)
    for q_len in (1, 6):
        table, ids, pos, mask, wb, wo = _inputs(pool, [2, 7], q_len)
        ref, got = _both(gqa_model, lean, pool, table, ids, pos, mask, wb, wo, 0)
        assert ref.shape == got.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        pool = _random_pool(gqa_model)


def test_unsupported_models_keep_transformers_forward(gqa_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    assert lean_forward_for(gpt2) is None
    gqa_model.config._attn_implementation = "eager"
    try:
        assert lean_forward_for(gqa_model) is None
    finally:
        gqa_model.config._attn_implementation = "sdpa"


def _config(kind: str):
    """A random-weight decoder of ``kind`` whose q|k|v and gate|up are big enough to be fused and packed."""
    import transformers

    dims = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
            "attn_implementation": "sdpa"}
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=64, tie_word_embeddings=True, **dims))
    if kind == "qwen2":  # q/k/v biases, no q/k norm
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False, **dims))
    dims["num_key_value_heads"] = 8  # Llama: plain multi-head attention, biases on q/k/v and o_proj
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=True, **dims))


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_fused_packed_forward_matches_the_module_forward(kind):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(1)
    model = _config(kind).eval()
    with torch.no_grad():  # random biases: the fused bias must land on the right outputs
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.normal_()
    lean = lean_forward_for(model, pack=True)
    assert lean is not None and lean.packed
    assert len(lean._fused) == 2 * model.config.num_hidden_layers  # q|k|v and gate|up of every layer
    fused_ptrs = {p for key in lean._fused for p in key}
    assert not fused_ptrs & set(lean._packed)  # no second pack of a fused weight
    unfused = lean_forward_for(model, pack=True, fuse=False)
    for q_len in (1, 5):  # decode and a prompt chunk
        pool = _random_pool(model)
        table, ids, pos, mask, wb, wo = _inputs(pool, [3, 9, 14], q_len)
        keep = torch.tensor([[q_len - 1], [0], [q_len - 1]])
        for k in (1, 0, keep):
            ref, got = _both(model, lean, pool, table, ids, pos, mask, wb, wo, k)
            assert ref.shape == got.shape
            assert (got - ref).abs().max().item() < 1e-4
        _, old = _both(model, unfused, pool, table, ids, pos, mask, wb, wo, keep)  # separate packed weights
        assert (got - old).abs().max().item() < 1e-4


def test_fused_weights_are_found_through_peft_and_missing_ones_fall_back(gqa_model):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    model = copy.deepcopy(gqa_model)
    lean = lean_forward_for(model, pack=True)
    assert lean is not None and lean._fused
    pool = _random_pool(model)
    table, ids, pos, mask, wb, wo = _inputs(pool, [2, 7], 1)
    ref, before = _both(model, lean, pool, table, ids, pos, mask, wb, wo, 1)
    # PEFT wraps q/k/v and gate/up in place; the lean forward reads their base layers' weights
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]),
                            model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert hasattr(attn.q_proj, "base_layer")
    x = torch.randn(1, 1, model.config.hidden_size)
    with torch.inference_mode():
        assert lean._fused_linear(x, (attn.q_proj, attn.k_proj, attn.v_proj)) is not None
        assert lean._fused_linear(x, (mlp.gate_proj, mlp.up_proj)) is not None
    _, wrapped = _both(model, lean, pool, table, ids, pos, mask, wb, wo, 1)
    assert torch.equal(wrapped, before)  # the same fused path, with the base weights
    # a layer whose fused weights are gone (e.g. replaced weights) runs its projections one by one
    for key in list(lean._fused)[:2]:
        del lean._fused[key]
    _, fallback = _both(model, lean, pool, table, ids, pos, mask, wb, wo, 1)
    assert (fallback - ref).abs().max().item() < 1e-4


def test_engine_greedy_with_fused_packed_weights_equals_generate(builtin_model_dir, monkeypatch):
    """The built-in model's weights are under PACK_MIN_ELEMENTS: a lower threshold packs and fuses them."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.runtime.sampling import SamplingParams

    monkeypatch.setattr("kiln.runtime.lean_forward.PACK_MIN_ELEMENTS", 1)
    reference = load_model(builtin_model_dir)
    engine = Engine(load_model(builtin_model_dir), EngineConfig(max_running_rows=4, max_model_len=256)).start()
    try:
        lean = engine._scheduler.batches.lean
        assert lean is not None and lean._fused
        questions = ["What is the capital of France?", "Count: 1 2 3", "Hi", "Tell me about the river and the sea."]
        prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in questions]
        params = SamplingParams(max_tokens=16, temperature=0)
        for p in prompts:
            out = engine.generate(p, params, timeout=60)[0]
            ids = torch.tensor([p])
            with torch.no_grad():
                expected = reference.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                                    do_sample=False)[0, len(p):].tolist()
            assert out.token_ids and out.token_ids == expected[: len(out.token_ids)]
            assert len(out.token_ids) == 16 or out.finish_reason == "stop"
    finally:
        engine.stop()


def test_packing_stops_at_the_memory_cap_and_the_rest_stays_on_f_linear(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    """Packed copies are made layer by layer while they fit the cap; a weight past it keeps
    F.linear, and the forward still matches the module forward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kiln.runtime import lean_forward as lf

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64, vocab_size=512, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    layer_bytes = 4 * (4 * 512 * 512 + 3 * 512 * 1024)  # one layer's projections, fp32
    monkeypatch.setattr(lf, "PACKED_WEIGHTS_MAX_BYTES", layer_bytes + 1000)
    lean = lf.LeanForward(model, pack=True)
    first, second = model.model.layers
    key = lambda *mods: tuple(m.weight.data_ptr() for m in mods)  # noqa: E731
    assert key(first.self_attn.q_proj, first.self_attn.k_proj, first.self_attn.v_proj) in lean._fused
    assert first.self_attn.o_proj.weight.data_ptr() in lean._packed
    assert key(second.mlp.gate_proj, second.mlp.up_proj) not in lean._fused
    assert second.mlp.down_proj.weight.data_ptr() not in lean._packed
    assert model.lm_head.weight.data_ptr() not in lean._packed
    pool = _random_pool(model)
    table, ids, pos, mask, wb, wo = _inputs(pool, [3, 9], 2)
    ref, got = _both(model, lean, pool, table, ids, pos, mask, wb, wo, 0)
    assert (got - ref).abs().max().item() < 1e-4
