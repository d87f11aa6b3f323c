"""Sparse knowledge-distillation loss with a coarse tail bucket (autodistill v1).

The teacher distribution at one position is stored sparsely: log p_i for the IDs
in S (top-k union forced, never renormalized) and the residual tail mass
p_tail = 1 - sum_{i in S} p_i. The student's distribution q is full. The loss is

    ce_weight * CE(q, target) + kd_weight * D_tail(P || Q)

    D_tail(P || Q) = sum_{i in S} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)

with q_tail = sum_{j not in S} q_j computed as a masked log-sum-exp (no
``1 - sum`` cancellation). When S is the whole vocabulary p_tail = 0 and D_tail
is exactly the dense forward KL(P || Q). Everything is computed in float32 (float64 when the logits are float64).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SparseKDLoss", "coarse_tail_kl", "linear_sparse_kd"]


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


def _kd_value_and_grad(z, ids0, teacher_lp, mask, tail, target, ce_w: float, kd_w: float, temp: float,
                       n: int, n_valid: int, need_grad: bool):
    """CE and coarse-tail KL sums over ``R`` rows of logits, and the gradient of the job's loss w.r.t. them.

    Args:
        z: ``[R, V]`` logits (float32, or float64); may be overwritten.
        ids0: ``[R, S]`` selected IDs with masked slots set to 0. ``teacher_lp``/``mask``: ``[R, S]``.
        tail: ``[R]``. target: ``[R]`` (-100 = no CE).
        n, n_valid: the whole batch's positions and CE positions (the means' denominators).

    Returns:
        ``(ce_sum [], kd_sum [] float64, grad [R, V] or None)`` where grad is
        d(ce_w * CE_sum / n_valid + kd_w * KD_sum / n)/dz.

    d/dz of D_tail at temperature T is (1/T) * (q_j (1 - r) for j outside S, q_j - p_j for j in S)
    with r = p_tail / q_tail; d/dz of CE is q^(1)_j - [j = target]. Two log-sum-exp passes forward,
    one exp-and-scale pass for the gradient.
    """
    valid = target != -100
    zero = z.new_zeros(())
    ce_sum, kd_sum = zero, zero.double()
    lse1 = lse_t = q_sel = r = p = None
    if ce_w and n_valid:
        lse1 = torch.logsumexp(z, dim=-1)
        picked = z.gather(-1, torch.where(valid, target, torch.zeros_like(target))[:, None])[:, 0]
        ce_sum = torch.where(valid, lse1 - picked, torch.zeros_like(lse1)).sum()
    if kd_w:
        zt = z if temp == 1.0 else z / temp
        lse_t = lse1 if (temp == 1.0 and lse1 is not None) else torch.logsumexp(zt, dim=-1)
        lq_sel = zt.gather(-1, ids0) - lse_t[:, None]  # [R, S]
        lp = torch.where(mask, teacher_lp.to(z.dtype), torch.zeros_like(lq_sel))
        p = torch.where(mask, lp.exp(), torch.zeros_like(lp))
        selected = (p * (lp - lq_sel)).sum(-1)
        q_sel = torch.where(mask, lq_sel.double().exp(), torch.zeros_like(lq_sel, dtype=torch.float64))
        q_tail = (1.0 - q_sel.sum(-1)).clamp(min=1e-30)  # float64 over [R, S] only
        tail64 = tail.double()
        has_tail = tail64 > 0
        safe = torch.where(has_tail, tail64, torch.ones_like(tail64))
        tail_term = torch.where(has_tail, tail64 * (safe.log() - q_tail.log()), torch.zeros_like(tail64))
        kd_sum = (selected.double() + tail_term).sum()
        r = torch.where(has_tail, tail64 / q_tail, torch.zeros_like(tail64)).to(z.dtype)
        q_sel = q_sel.to(z.dtype)
    if not need_grad:
        return ce_sum, kd_sum, None
    grad = None
    w = ce_w / n_valid if (ce_w and n_valid) else 0.0
    ce_pending = bool(w)
    if kd_w:
        zt = z if temp == 1.0 else z / temp
        scale = (kd_w / (n * temp)) * (1.0 - r)  # [R]
        if ce_pending and temp == 1.0:
            # One softmax serves both terms: q * (kd scale + ce scale) in a single pass.
            scale = scale + valid.to(z.dtype) * w
            ce_pending = False
        fix = torch.where(mask, q_sel * r[:, None] - p, torch.zeros_like(p)) * (kd_w / (n * temp))
        # In place: when zt is z (T = 1), a CE term was folded into ``scale``, so z is not read again.
        grad = zt.sub_(lse_t[:, None]).exp_().mul_(scale[:, None])
        grad.scatter_add_(-1, ids0, fix)
    if ce_pending:
        q1 = (z - lse1[:, None]).exp_().mul_((valid.to(z.dtype) * w)[:, None])
        grad = q1 if grad is None else grad.add_(q1)
    if w:
        rows = torch.nonzero(valid)[:, 0]
        grad[rows, target[rows]] -= w
    if grad is None:
        grad = torch.zeros_like(z)
    return ce_sum, kd_sum, grad


def _means(ce_sum, kd_sum, dtype, ce_w: float, kd_w: float, n: int, n_valid: int):
    ce = ce_sum / n_valid if (ce_w and n_valid) else ce_sum
    kd = kd_sum.to(dtype) / n
    return ce_w * ce + kd_w * kd, ce.detach(), kd.detach()


class _FusedSparseKD(torch.autograd.Function):
    """CE + coarse-tail KL over ``[N, V]`` logits, gradient computed in forward (see ``_kd_value_and_grad``).

    Autograd through the reference formulation needs ~6 passes over [N, V]; this needs two forward
    (log-sum-exp) and one gradient pass (exp, scale).
    """

    @staticmethod
    def forward(ctx, logits, ids, teacher_lp, mask, tail, target, ce_weight, kd_weight, temperature):
        z = logits if logits.dtype == torch.float64 else logits.float()  # float32 at least
        if z is logits:
            z = z.clone()  # the gradient pass reuses z's storage
        n, n_valid = z.shape[0], int((target != -100).sum())
        ids0 = torch.where(mask, ids, torch.zeros_like(ids))
        ce_sum, kd_sum, grad = _kd_value_and_grad(z, ids0, teacher_lp, mask, tail, target, float(ce_weight),
                                                  float(kd_weight), float(temperature), n, n_valid,
                                                  ctx.needs_input_grad[0])
        ctx.save_for_backward(*(() if grad is None else (grad,)))
        ctx.dtype = logits.dtype
        return _means(ce_sum, kd_sum, z.dtype, float(ce_weight), float(kd_weight), n, n_valid)

    @staticmethod
    def backward(ctx, g, _g_ce, _g_kd):
        (grad,) = ctx.saved_tensors
        return (grad * g).to(ctx.dtype), None, None, None, None, None, None, None, None


def linear_sparse_kd(h, weight, ids, teacher_logprobs, mask, tail, target, *, ce_weight: float = 1.0,
                     kd_weight: float = 1.0, temperature: float = 1.0, chunk_rows: int | None = None):
    """:class:`SparseKDLoss` from hidden states: ``(loss [], {"ce", "kd"})`` without ``[N, V]`` logits.

    The head runs one chunk of rows at a time (:func:`kiln.training.losses.chunked.linear_chunked_loss`), each
    chunk's gradient (``_kd_value_and_grad``) folded into d/dh and d/dW during forward.

    Args:
        h: ``[N, H]`` final-norm hidden states at the captured positions.
        weight: ``[V, H]`` the LM head's weight (a plain, bias-free head; see
            :func:`kiln.training.losses.chunked.split_causal_lm`).
        ids, teacher_logprobs, mask, tail, target: as for :class:`SparseKDLoss`.
        chunk_rows: rows of logits alive at once (default: ``chunked_loss.CHUNK_ELEMENTS // V``).
    """
    from kiln.training.losses.chunked import chunk_rows as default_rows
    from kiln.training.losses.chunked import linear_chunked_loss

    ce_w, kd_w, temp = float(ce_weight), float(kd_weight), float(temperature)
    acc = torch.promote_types(h.dtype, torch.float32)  # the logits' dtype in each chunk
    n, n_valid = h.shape[0], int((target != -100).sum())
    ids0 = torch.where(mask, ids, torch.zeros_like(ids))

    def chunk(z, sl, need_grad):
        ce_sum, kd_sum, gz = _kd_value_and_grad(z, ids0[sl], teacher_logprobs[sl], mask[sl], tail[sl], target[sl],
                                                ce_w, kd_w, temp, n, n_valid, need_grad)
        return (ce_sum, kd_sum), gz

    loss, ce, kd = linear_chunked_loss(h, weight, chunk_rows or default_rows(weight.shape[0]), chunk,
                                       lambda ce_sum, kd_sum: _means(ce_sum, kd_sum, acc, ce_w, kd_w, n, n_valid))
    return loss, {"ce": ce, "kd": kd}


class SparseKDLoss(nn.Module):
    """CE on the target token plus coarse-tail forward KL from the sparse teacher.

    Args:
        ce_weight: weight of cross-entropy on ``target``.
        kd_weight: weight of the mean D_tail(P || Q).
        temperature: the plan's capture temperature T; the student is compared at
            ``logits / T`` (the teacher was captured at the same T). No T**2 factor is
            applied: put it in ``kd_weight`` if wanted.
        fused: use the hand-written backward (default); ``False`` runs plain autograd
            through ``coarse_tail_kl`` (the reference the tests compare against).

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

    def __init__(self, ce_weight: float = 1.0, kd_weight: float = 1.0, temperature: float = 1.0, fused: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        self.ce_weight, self.kd_weight, self.temperature = float(ce_weight), float(kd_weight), float(temperature)
        self.fused = fused

    def forward(self, logits, ids, teacher_logprobs, mask, tail, target):
        if self.fused:
            loss, ce, kd = _FusedSparseKD.apply(
                logits, ids, teacher_logprobs, mask, tail, target, self.ce_weight, self.kd_weight, self.temperature
            )
            return loss, {"ce": ce, "kd": kd}
        logits = logits.float()
        zero = logits.new_zeros(())
        ce = zero
        if self.ce_weight and bool((target != -100).any()):
            ce = nn.functional.cross_entropy(logits, target, ignore_index=-100)
        kd = zero
        if self.kd_weight:
            lq = torch.log_softmax(logits / self.temperature, dim=-1)
            kd = coarse_tail_kl(lq, ids, teacher_logprobs.float(), mask, tail.float()).mean()
        loss = self.ce_weight * ce + self.kd_weight * kd
        return loss, {"ce": ce.detach(), "kd": kd.detach()}
