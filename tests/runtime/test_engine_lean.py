"""The engine's lean forward (kiln.runtime.lean_forward) against transformers' own module forward.

A small Qwen3 with grouped-query attention (4 query heads over 2 KV heads) and Linear
weights big enough to be packed for oneDNN, random weights, built in memory. Both
forwards read and write the same paged KV pool through the same block tables.
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
    pool = BlockPool(cache_shape(gqa_model.config), 32, 4, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        for t in pool.keys + pool.values:
            t.normal_()
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
    pool = BlockPool(cache_shape(gqa_model.config), 32, 4, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        for t in pool.keys + pool.values:
            t.normal_()
    for q_len in (1, 6):
        table, ids, pos, mask, wb, wo = _inputs(pool, [2, 7], q_len)
        ref, got = _both(gqa_model, lean, pool, table, ids, pos, mask, wb, wo, 0)
        assert ref.shape == got.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        pool = BlockPool(cache_shape(gqa_model.config), 32, 4, device="cpu", dtype=torch.float32)
        with torch.inference_mode():
            for t in pool.keys + pool.values:
                t.normal_()


def test_unsupported_models_keep_transformers_forward(gqa_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    assert lean_forward_for(gpt2) is None
    gqa_model.config._attn_implementation = "eager"
    try:
        assert lean_forward_for(gqa_model) is None
    finally:
        gqa_model.config._attn_implementation = "sdpa"
