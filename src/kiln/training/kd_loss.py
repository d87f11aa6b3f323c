"""Sparse knowledge-distillation loss with a coarse tail bucket (autodistill v1).

The teacher distribution at one position is stored sparsely: log p_i for the IDs
in S (top-k union forced, never renormalized) and the residual tail mass
p_tail = 1 - sum_{i in S} p_i. The student's distribution q is full. The loss is

    ce_weight * CE(q, target) + kd_weight * D_tail(P || Q)

    D_tail(P || Q) = sum_{i in S} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)

with q_tail = sum_{j not in S} q_j computed as a masked log-sum-exp (no
``1 - sum`` cancellation). When S is the whole vocabulary p_tail = 0 and D_tail
is exactly the dense forward KL(P || Q). Everything is computed in float32.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SparseKDLoss", "coarse_tail_kl"]


def coarse_tail_kl(
    student_logprobs: torch.Tensor,
    ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    tail: torch.Tensor,
) -> torch.Tensor:
    """Per-position D_tail(P || Q).

    Args:
        student_logprobs: ``[N, V]`` student log-probabilities (float32).
        ids: ``[N, S]`` int64 teacher-selected IDs (any value where ``mask`` is False).
        teacher_logprobs: ``[N, S]`` teacher log p of ``ids`` (ignored where masked).
        mask: ``[N, S]`` bool, True for a real selected ID (each ID at most once per row).
        tail: ``[N]`` teacher tail mass p_tail >= 0.

    Returns:
        ``[N]`` KL values in nats.
    """
    ids = torch.where(mask, ids, torch.zeros_like(ids))
    lq_sel = student_logprobs.gather(-1, ids)  # [N, S]
    lp = torch.where(mask, teacher_logprobs, torch.zeros_like(teacher_logprobs))
    p = torch.where(mask, lp.exp(), torch.zeros_like(lp))
    selected = (p * (lp - lq_sel)).sum(-1)  # [N]
    # log q_tail = logsumexp over IDs outside S: push selected IDs to a large
    # finite negative (not -inf, so an empty tail has finite, zero-weighted grads).
    # scatter_add of the mask (not scatter of values): padded slots pointing at a
    # real ID add zero instead of racing to overwrite it.
    in_s = torch.zeros_like(student_logprobs).scatter_add_(-1, ids, mask.to(student_logprobs.dtype)) > 0
    very_negative = torch.finfo(student_logprobs.dtype).min / 2
    outside = torch.where(in_s, torch.full_like(student_logprobs, very_negative), student_logprobs)
    log_q_tail = torch.logsumexp(outside, dim=-1)  # [N]
    has_tail = tail > 0
    safe_tail = torch.where(has_tail, tail, torch.ones_like(tail))
    tail_term = torch.where(has_tail, tail * (safe_tail.log() - log_q_tail), torch.zeros_like(tail))
    return selected + tail_term


class SparseKDLoss(nn.Module):
    """CE on the target token plus coarse-tail forward KL from the sparse teacher.

    Args:
        ce_weight: weight of cross-entropy on ``target``.
        kd_weight: weight of the mean D_tail(P || Q).
        temperature: the plan's capture temperature T; the student is compared at
            ``logits / T`` (the teacher was captured at the same T). No T**2 factor is
            applied: put it in ``kd_weight`` if wanted.

    Forward:
        logits: ``[N, V]`` student logits at the N captured positions (any float dtype).
        ids: ``[N, S]`` int64 teacher-selected IDs, padded.
        teacher_logprobs: ``[N, S]`` float teacher log p (padded entries ignored).
        mask: ``[N, S]`` bool, True for real entries.
        tail: ``[N]`` float teacher tail mass.
        target: ``[N]`` int64 CE target (-100 to ignore a position).

    Returns:
        ``(loss [], parts)`` where ``parts = {"ce": [], "kd": []}`` are detached means.
    """

    def __init__(self, ce_weight: float = 1.0, kd_weight: float = 1.0, temperature: float = 1.0):
        super().__init__()
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        self.ce_weight, self.kd_weight, self.temperature = float(ce_weight), float(kd_weight), float(temperature)

    def forward(self, logits, ids, teacher_logprobs, mask, tail, target):
        logits = logits.float()
        zero = logits.new_zeros(())
        ce = zero
        if self.ce_weight:
            ce = nn.functional.cross_entropy(logits, target, ignore_index=-100)
            if not torch.isfinite(ce):  # every target ignored
                ce = zero
        kd = zero
        if self.kd_weight:
            lq = torch.log_softmax(logits / self.temperature, dim=-1)
            kd = coarse_tail_kl(lq, ids, teacher_logprobs.float(), mask, tail.float()).mean()
        loss = self.ce_weight * ce + self.kd_weight * kd
        return loss, {"ce": ce.detach(), "kd": kd.detach()}
