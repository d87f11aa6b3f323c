"""The chunked LM-head losses equal the plain full-logits losses, values and gradients."""

from __future__ import annotations

import pytest
import torch

from kiln.training.losses.chunked import (
    linear_cross_entropy_sum,
    linear_token_logprobs,
    sft_loss_from_hidden,
    split_causal_lm,
)
from kiln.training.losses.sft import sft_loss, shifted_token_logprobs

TOL = 1e-5


def _peft(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))
    model.train()
    return model


def _batch(vocab: int, b: int = 3, t: int = 17):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (b, t), generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.4).long()
    mask[:, 0] = 0
    mask[0, 5] = 1
    return ids, mask


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare_sft(model, vocab: int, chunk_elements: int):
    ids, mask = _batch(vocab)
    plain = sft_loss(model(input_ids=ids, use_cache=False).logits, ids, mask)
    plain.backward()
    g_plain = _grads(model)
    model.zero_grad(set_to_none=True)
    split = split_causal_lm(model)
    assert split is not None
    chunked = sft_loss_from_hidden(split.hidden(ids), split.head.weight, ids, mask, chunk_elements=chunk_elements)
    chunked.backward()
    g_chunked = _grads(model)
    model.zero_grad(set_to_none=True)
    assert chunked.item() == pytest.approx(plain.item(), rel=TOL)
    assert g_plain.keys() == g_chunked.keys() and g_plain
    for n in g_plain:
        torch.testing.assert_close(g_chunked[n], g_plain[n], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("chunk_elements", [1, 7 * 1000, 1 << 30])
def test_sft_chunked_equals_plain_on_builtin(builtin_model_dir, chunk_elements):
    model = _peft(builtin_model_dir)
    _compare_sft(model, model.config.vocab_size, chunk_elements)


def test_sft_chunked_equals_plain_on_a_32k_vocab(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    model = _peft(tmp_path)
    _compare_sft(model, cfg.vocab_size, 32000 * 5)


def test_linear_cross_entropy_gradients_for_head_weight_too():
    torch.manual_seed(0)
    h = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (11,))
    got = linear_cross_entropy_sum(h, w, y, chunk_elements=150)
    gh, gw = torch.autograd.grad(got * 0.7, (h, w))
    want = torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="sum")
    wh, ww = torch.autograd.grad(want * 0.7, (h, w))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(gh, wh)
    torch.testing.assert_close(gw, ww)


def test_token_logprobs_equal_plain_with_gradients():
    torch.manual_seed(0)
    h = torch.randn(2, 9, 8, requires_grad=True)
    w = torch.randn(40, 8)
    ids = torch.randint(0, 40, (2, 9))
    want = shifted_token_logprobs(h @ w.t(), ids)
    got = linear_token_logprobs(h[:, :-1].reshape(16, 8), w, ids[:, 1:].reshape(-1), chunk_elements=120).view(2, 8)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    coef = torch.randn(2, 8)
    (g_want,) = torch.autograd.grad((want * coef).sum(), h)
    (g_got,) = torch.autograd.grad((got * coef).sum(), h)
    torch.testing.assert_close(g_got, g_want, rtol=TOL, atol=TOL)


def test_sft_from_hidden_rejects_empty_mask():
    with pytest.raises(ValueError, match="no target tokens"):
        sft_loss_from_hidden(torch.zeros(1, 3, 4), torch.zeros(5, 4), torch.zeros(1, 3, dtype=torch.long),
                             torch.zeros(1, 3))


def test_split_refuses_a_model_it_does_not_know():
    assert split_causal_lm(torch.nn.Linear(2, 2)) is None
