"""The GRPO objective: group-relative advantages, the KL penalty and the clipped surrogate loss.

Shapes in the docstrings. Notation: ``B`` batch rows, ``T`` sequence length, ``G`` completions
in one group. Masks are ``bool`` or ``0/1`` tensors; padded positions carry 0.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

GRPO_CLIP_EPSILON = 0.2
ADVANTAGE_STD_EPS = 1e-6
ZERO_VARIANCE_TOL = 1e-12
KLEstimator = Literal["k1", "k3"]


def group_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True) -> torch.Tensor | None:
    """Group-relative advantages for one group of completions.

    Args:
        rewards: ``[G]`` scalar rewards of the completions of one prompt.
        scale_by_std: divide the centred rewards by the group's sample standard
            deviation (Bessel-corrected, ``+ ADVANTAGE_STD_EPS``).

    Returns:
        ``[G]`` float32 advantages ``r_i - mean(r)`` (optionally divided by the
        std), or ``None`` when every reward in the group is equal: such a group
        carries no learning signal and is skipped.
    """
    r = rewards.to(torch.float64)
    if r.numel() < 2 or float(r.max() - r.min()) <= ZERO_VARIANCE_TOL:
        return None
    adv = r - r.mean()
    if scale_by_std:
        adv = adv / (r.std(unbiased=True) + ADVANTAGE_STD_EPS)
    return adv.to(torch.float32)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    Args:
        logp: ``[B, L]`` policy log-probabilities of the sampled tokens.
        ref_logp: ``[B, L]`` reference-policy log-probabilities of the same tokens.
        estimator: ``"k1"``: ``logp - ref_logp`` (unbiased, can be negative);
            ``"k3"``: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, never negative).

    Returns:
        ``[B, L]`` per-token KL estimates.
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        delta = ref_logp - logp
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1' or 'k3'")


class GRPOLoss(nn.Module):
    """Token-level clipped surrogate with an optional KL penalty to a reference policy.

    For every completion token ``t`` of row ``b``::

        ratio = exp(logp - old_logp)
        surr  = min(ratio * A_b, clip(ratio, 1 - eps, 1 + eps) * A_b)
        loss_t = -surr + kl_coef * KL_t

    and the loss is the sum of ``loss_t`` over all masked tokens of the batch
    divided by their count (every token weighs the same, whatever the length of
    its completion).
    """

    def __init__(self, epsilon: float = GRPO_CLIP_EPSILON, kl_coef: float = 0.0, kl_estimator: KLEstimator = "k3"):
        super().__init__()
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if kl_estimator not in ("k1", "k3"):
            raise ValueError(f"unknown KL estimator {kl_estimator!r}; use 'k1' or 'k3'")
        self.epsilon = epsilon
        self.kl_coef = kl_coef
        self.kl_estimator: KLEstimator = kl_estimator

    def forward(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """
        Args:
            logp: ``[B, L]`` current-policy log-probabilities of the completion tokens.
            old_logp: ``[B, L]`` log-probabilities under the policy the ratio is
                taken against (no gradient flows through it).
            advantages: ``[B]`` one advantage per completion row.
            mask: ``[B, L]``; 1 on completion tokens, 0 on prompt and padding.
            ref_logp: ``[B, L]`` reference-policy log-probabilities; required when
                ``kl_coef > 0``.

        Returns:
            ``(loss, stats)``: scalar loss and floats ``clip_fraction`` (share of
            tokens whose ratio was clipped) and ``kl`` (mean KL estimate, 0 when off).
        """
        m = mask.to(torch.float32)
        count = m.sum()
        if count.item() == 0:
            raise ValueError("GRPOLoss: no completion tokens in the batch (empty mask)")
        ratio = torch.exp(logp - old_logp.detach())
        adv = advantages.to(logp.dtype).unsqueeze(-1)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon) * adv
        per_token = -torch.minimum(unclipped, clipped)
        kl_mean = 0.0
        if self.kl_coef > 0:
            if ref_logp is None:
                raise ValueError("GRPOLoss: ref_logp is required when kl_coef > 0")
            kl = kl_penalty(logp, ref_logp.detach(), self.kl_estimator)
            per_token = per_token + self.kl_coef * kl
            kl_mean = float(((kl * m).sum() / count).detach())
        loss = (per_token * m).sum() / count
        was_clipped = ((ratio - torch.clamp(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon)).abs() > 0).float()
        clip_fraction = float(((was_clipped * m).sum() / count).detach())
        return loss, {"clip_fraction": clip_fraction, "kl": kl_mean}
