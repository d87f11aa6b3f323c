"""On-policy distillation (OPD) losses.

All per completion token, averaged over the batch's tokens:

* :class:`TailForwardKL` (``forward``, default): forward KL(p || q) over
  S = teacher top-K plus the sampled token, with one extra bucket holding the
  mass outside S on each side. Its gradient on a student logit is ``q_v - p_v``:
  it raises the teacher's choice however little mass the student gives it.
* :class:`TailReverseKL` (``tail``): reverse KL(q || p) over the same S and bucket.
  Nothing is renormalised; with K = vocabulary it is the full reverse KL.
* :class:`RenormalizedReverseKL` (``renormalized``): reverse KL with both sides
  renormalised over the teacher's top-K only (kept for comparison).
* :class:`SampledTokenLoss` (``sampled_token``): the one-sample reverse-KL
  estimator (as Tinker's on-policy distillation): advantage ``log p(x) - log q(x)``
  of the sampled token, importance-weighted to the policy that sampled it (the
  student at the sampling temperature).

Why reverse KL is not the default (docs/training.md, bench/opd_transfer.py): its
gradient on a token is proportional to the student's own probability of it, so a
confident student that gives the teacher's answer almost no mass is first pushed
off its own answer (entropy rises, samples leave the teacher's top-K, the tail
bucket takes most of the loss) and finds the teacher's token only by chance.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

EPS = 1e-12


def _xlogy_ratio(a: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``a * (log_a - log_b)`` with ``0 * anything = 0``."""
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a))


def _bucket_kl(log_a: torch.Tensor, log_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` KL(a || b) over the candidates (``[N, C]`` log-probabilities, ``mask`` True where real) plus one
    bucket per side for the mass outside them (``1 - sum``, clamped at EPS inside the log)."""
    a, b = log_a.exp() * mask, log_b.exp() * mask
    inside = (_xlogy_ratio(a, log_a, log_b) * mask).sum(-1)
    a_out = (1.0 - a.sum(-1)).clamp(min=0.0)
    b_out = (1.0 - b.sum(-1)).clamp(min=0.0)
    return inside + _xlogy_ratio(a_out, torch.log(a_out.clamp(min=EPS)), torch.log(b_out.clamp(min=EPS)))


class _CandidateLoss(nn.Module):
    """A loss on the student's log-probabilities of the teacher's candidates (``from_logq``).

    Args (forward):
        student_logits: ``[N, V]`` student logits at N completion positions.
        cand_ids: ``[N, C]`` teacher candidate token IDs (top-K, plus the sampled token where the loss says), padded.
        cand_logp: ``[N, C]`` teacher log-probabilities of those candidates (raw, not renormalised).
        cand_mask: ``[N, C]`` True where a candidate is real (padding False; each ID at most once per row).
    """

    def forward(self, student_logits: torch.Tensor, cand_ids: torch.Tensor, cand_logp: torch.Tensor,
                cand_mask: torch.Tensor) -> torch.Tensor:
        logq = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, cand_ids.clamp(min=0))
        return self.from_logq(logq, cand_logp, cand_mask)

    @staticmethod
    def from_logq(logq: torch.Tensor, cand_logp: torch.Tensor, cand_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TailReverseKL(_CandidateLoss):
    """Reverse KL(q || p) over S = candidates (top-K plus the sampled token), plus one bucket for the mass
    outside S on each side.

    Returns: scalar, mean over the N positions of
        ``sum_{s in S} q_s (log q_s - log p_s) + q_out (log q_out - log p_out)``,
        ``q_out = 1 - sum_S q``, ``p_out = 1 - sum_S p`` (clamped at EPS inside the log).
    """

    @staticmethod
    def from_logq(logq: torch.Tensor, cand_logp: torch.Tensor, cand_mask: torch.Tensor) -> torch.Tensor:
        """The same loss from ``logq`` ``[N, C]``: the student's full-vocabulary log-probabilities of the
        candidates, as :func:`kiln.training.opd.head.candidate_loss_mean` gives them)."""
        return _bucket_kl(logq, cand_logp, cand_mask).mean()


class TailForwardKL(_CandidateLoss):
    """Forward KL(p || q) over S = candidates (top-K plus the sampled token), plus one bucket for the mass
    outside S on each side.

    Returns: scalar, mean over the N positions of
        ``sum_{s in S} p_s (log p_s - log q_s) + p_out (log p_out - log q_out)``.
        With K = vocabulary it is the full forward KL; its gradient on logit ``z_v`` is ``q_v - p_v`` on S.
    """

    @staticmethod
    def from_logq(logq: torch.Tensor, cand_logp: torch.Tensor, cand_mask: torch.Tensor) -> torch.Tensor:
        """The same loss from the student's full-vocabulary candidate log-probabilities ``[N, C]``."""
        return _bucket_kl(cand_logp, logq, cand_mask).mean()


class RenormalizedReverseKL(_CandidateLoss):
    """Reverse KL with both distributions renormalised over the teacher's top-K (``cand_*`` hold it only).

    Returns: scalar, mean over positions of ``sum_K q'_k (log q'_k - log p'_k)``,
        ``q' = q_K / sum q_K``, ``p' = p_K / sum p_K``.
    """

    @staticmethod
    def from_logq(logq: torch.Tensor, cand_logp: torch.Tensor, cand_mask: torch.Tensor) -> torch.Tensor:
        """The same loss from the student's candidate log-probabilities ``[N, C]`` (any normalisation)."""
        neg = torch.finfo(torch.float32).min
        logq = torch.log_softmax(logq.masked_fill(~cand_mask, neg), dim=-1)
        logp = torch.log_softmax(cand_logp.masked_fill(~cand_mask, neg), dim=-1)
        q = logq.exp() * cand_mask
        return ((q * (logq - logp)) * cand_mask).sum(-1).mean()


class SampledTokenLoss(nn.Module):
    """Single-sample reverse-KL estimator as an importance-weighted policy gradient (Tinker-style).

    Args (forward):
        student_logp: ``[N]`` log q of each sampled token at temperature 1 (with grad).
        teacher_logp: ``[N]`` log p of the same tokens.
        sampler_logp: ``[N]`` log-probability of each token under the policy that sampled it (the student
            at the sampling temperature, detached); ``None``: sampled at temperature 1 (ratio 1).
    Returns: scalar ``-mean(r * A)``, ``A = log p - log q`` (detached: the per-token reverse-KL advantage),
        ``r = exp(log q - sampler_logp)``, so the gradient ``-mean(r * A * grad log q)`` is, in expectation over
        the sampler, the gradient of the per-token reverse KL of q.
    """

    def forward(self, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                sampler_logp: torch.Tensor | None = None) -> torch.Tensor:
        adv = (teacher_logp - student_logp).detach()
        behaviour = student_logp.detach() if sampler_logp is None else sampler_logp.detach()
        return -(torch.exp(student_logp - behaviour) * adv).mean()


def full_reverse_kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Reference: mean over positions of sum_v q_v (log q_v - log p_v); ``[N, V]`` inputs."""
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    return (logq.exp() * (logq - teacher_logp)).sum(-1).mean()


def candidates(rows: Sequence[dict[int, float]], sampled: Sequence[int], top_k: int, *, include_sampled: bool,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher rows (token ID -> logprob) -> ``[N, C]`` ids, logprobs, mask.

    Each row keeps its ``top_k`` most likely tokens, plus the sampled token when ``include_sampled``.
    """
    picked: list[list[tuple[int, float]]] = []
    for row, tok in zip(rows, sampled):
        best = sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]
        if include_sampled and tok in row and all(t != tok for t, _ in best):
            best.append((tok, row[tok]))
        picked.append(best)
    width = max(1, max((len(p) for p in picked), default=0))
    ids = [[t for t, _ in p] + [0] * (width - len(p)) for p in picked]
    logp = [[lp for _, lp in p] + [0.0] * (width - len(p)) for p in picked]
    mask = [[True] * len(p) + [False] * (width - len(p)) for p in picked]
    return (torch.tensor(ids, dtype=torch.long, device=device).view(-1, width),
            torch.tensor(logp, dtype=torch.float32, device=device).view(-1, width),
            torch.tensor(mask, dtype=torch.bool, device=device).view(-1, width))


def outside_top_k(rows: Sequence[dict[int, float]], sampled: Sequence[int], top_k: int) -> float:
    """Share of the sampled tokens that are not among the teacher's ``top_k`` at their position: a student
    drifting off the teacher's support (rising towards 1 as it degenerates; ~0 once it follows the teacher)."""
    if not sampled:
        return 0.0
    out = sum(tok not in {t for t, _ in sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]}
              for row, tok in zip(rows, sampled))
    return out / len(sampled)


def teacher_token_logp(rows: Sequence[dict[int, float]], sampled: Sequence[int]) -> torch.Tensor:
    """log p of each sampled token; when the teacher did not return it, its tail mass bounds it."""
    out = []
    for row, tok in zip(rows, sampled):
        if tok in row:
            out.append(row[tok])
        else:
            out.append(math.log(max(EPS, 1.0 - sum(math.exp(v) for v in row.values()))))
    return torch.tensor(out, dtype=torch.float32)


CANDIDATE_LOSSES: dict[str, Any] = {"forward": TailForwardKL, "tail": TailReverseKL,
                                    "renormalized": RenormalizedReverseKL}
