"""Losses against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.training.losses.grpo import GRPOLoss, group_advantages, kl_penalty
from kiln.training.losses.sft import sft_loss, shifted_token_logprobs


def _logsumexp(xs):
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def test_sft_loss_is_mean_nll_over_masked_targets():
    logits = torch.tensor([[[1.0, 2.0, 0.5], [0.1, 0.2, 3.0], [2.0, -1.0, 0.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[0, 2, 1, 0]])
    mask = torch.tensor([[0, 1, 0, 1]])  # targets: token 2 at t=1 (from logits[0]), token 0 at t=3 (from logits[2])
    nll_1 = _logsumexp([1.0, 2.0, 0.5]) - 0.5
    nll_3 = _logsumexp([2.0, -1.0, 0.0]) - 2.0
    assert sft_loss(logits, ids, mask).item() == pytest.approx((nll_1 + nll_3) / 2, rel=1e-6)


def test_sft_loss_weighs_tokens_not_rows():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 1, 0, 0, 0], [0, 1, 1, 1, 1]])
    lp = shifted_token_logprobs(logits, ids)
    expected = -(lp * mask[:, 1:]).sum() / 5
    assert sft_loss(logits, ids, mask).item() == pytest.approx(expected.item(), rel=1e-6)


def test_sft_loss_rejects_empty_mask():
    with pytest.raises(ValueError, match="no target tokens"):
        sft_loss(torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3))


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 2.0, 6.0]), scale_by_std=False)
    assert adv.tolist() == pytest.approx([-2.0, -1.0, 3.0])
    # sample std of [1, 2, 6] = sqrt(((-2)^2 + 1 + 9) / 2) = sqrt(7)
    scaled = group_advantages(torch.tensor([1.0, 2.0, 6.0]), scale_by_std=True)
    s = math.sqrt(7.0) + 1e-6
    assert scaled.tolist() == pytest.approx([-2.0 / s, -1.0 / s, 3.0 / s], rel=1e-6)


def test_zero_variance_group_gives_none():
    assert group_advantages(torch.tensor([0.5, 0.5, 0.5]), scale_by_std=True) is None
    assert group_advantages(torch.tensor([3.0]), scale_by_std=False) is None


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    assert kl_penalty(logp, ref, "k1").tolist()[0] == pytest.approx([0.5, -1.0])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert kl_penalty(logp, ref, "k3").tolist()[0] == pytest.approx(k3, rel=1e-6)
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k2")  # type: ignore[arg-type]


def test_grpo_clipped_surrogate_by_hand():
    # Row 0: A=+1; ratios e^0.5 (clipped to 1.2 -> min picks 1.2) and e^-0.5 (0.6065: unclipped smaller).
    # Row 1: A=-2; ratios e^0.1 (1.105, inside) and e^-1 (0.3679 -> clipped 0.8; min(-0.736, -1.6) = -1.6).
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.5, -0.5, 9.0], [0.1, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = GRPOLoss(epsilon=0.2)(logp, old, adv, mask)
    per_token = [-1.2, -math.exp(-0.5), 2.0 * math.exp(0.1), 1.6]
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-6)
    assert stats["clip_fraction"] == pytest.approx(3 / 4)  # e^0.5, e^-0.5 and e^-1 fall outside [0.8, 1.2]
    assert stats["kl"] == 0.0


def test_grpo_kl_term_and_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.tensor([[1, 1]])
    loss, stats = GRPOLoss(kl_coef=0.1, kl_estimator="k1")(logp, logp.detach(), torch.tensor([0.5]), mask, ref)
    # ratio == 1 everywhere: surrogate = -A per token; k1 = [0.5, -1.0]
    assert loss.item() == pytest.approx((-0.5 + 0.05 - 0.5 - 0.1) / 2, rel=1e-6)
    assert stats["kl"] == pytest.approx(-0.25)
    loss.backward()
    # d/dlogp of -ratio*A is -A*ratio = -0.5; of 0.1*(logp-ref) is 0.1; averaged over 2 tokens.
    assert logp.grad.tolist()[0] == pytest.approx([(-0.5 + 0.1) / 2, (-0.5 + 0.1) / 2])


def test_grpo_requires_reference_when_kl_on():
    with pytest.raises(ValueError, match="ref_logp"):
        GRPOLoss(kl_coef=0.1)(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
