"""The LM head and its losses without materialising ``[B, T, V]`` logits.

A causal LM's loss only needs the logits at the supervised positions, and only
one chunk of them at a time. :func:`split_causal_lm` splits a model into its
trunk (embeddings, decoder layers, final norm: the hidden states the model's
own ``lm_head`` reads) and that head, for the architectures whose forward is
exactly ``lm_head(model(...).last_hidden_state)`` (no logit scaling or
soft-capping). For anything else it returns ``None`` and callers keep the
plain ``model(...).logits`` path.

Shapes: ``N`` selected positions, ``H`` hidden size, ``V`` vocabulary.

* :func:`linear_chunked_loss`: the head applied one chunk of rows at a time,
  each chunk's loss value and logit gradient supplied by the caller and folded
  into d/dh and d/dW during the forward pass (one chunk of logits alive at a
  time, computed once), so backward is a multiply. SFT's cross-entropy
  (:func:`linear_cross_entropy_sum`), OPD's candidate losses
  (:func:`kiln.training.opd.head.candidate_loss_mean`) and sparse KD
  (:func:`kiln.training.losses.kd.linear_sparse_kd`) all run on it.
* :func:`linear_token_logprobs`: ``log softmax(h_n W^T)[y_n]`` with autograd,
  each chunk recomputed in backward (``torch.utils.checkpoint``), for GRPO.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Logit elements (rows x vocabulary) alive per chunk: 2M float32 = 8 MiB (8M measured 70 MiB more peak RSS at 32k vocab).
CHUNK_ELEMENTS = 2 * 1024 * 1024
# Model classes whose forward is exactly lm_head(model(...).last_hidden_state).
PLAIN_HEAD_MODELS = frozenset({
    "Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
})


@dataclass(frozen=True)
class SplitLM:
    """The trunk (``[B, T] -> [B, T, H]`` final-norm hidden states) and the head weight ``[V, H]``."""

    trunk: nn.Module
    head: nn.Linear

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` that restart at 0 mark packed rows (see :func:`kiln.training.core.data.collate_packed`)."""
        return self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state


def split_causal_lm(peft_model: Any) -> SplitLM | None:
    """The served ``PeftModel``'s trunk and plain head, or ``None`` when the fast path does not apply.

    LoRA layers are injected in place, so the trunk runs the active adapter (and
    honours ``disable_adapter()``) exactly as the full forward does. A head that
    is itself a LoRA target, has a bias, or a model class not known to apply the
    head plainly disables the fast path.
    """
    causal = getattr(getattr(peft_model, "base_model", None), "model", None)
    if causal is None or type(causal).__name__ not in PLAIN_HEAD_MODELS:
        return None
    head = causal.get_output_embeddings()
    trunk = getattr(causal, "model", None)
    if type(head) is not nn.Linear or head.bias is not None or trunk is None:
        return None
    return SplitLM(trunk, head)


def chunk_rows(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // max(1, vocab))


class _LinearChunkedLoss(torch.autograd.Function):
    """See :func:`linear_chunked_loss`."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, rows: int,  # type: ignore[override]
                chunk_fn: Callable[..., Any], finish: Callable[..., Any] | None) -> Any:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(h.dtype, torch.float32)  # float32 at least
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        sums: list[torch.Tensor] = []
        for s in range(0, max(h.shape[0], 1), rows):  # no rows: one empty chunk, no gradient, zero sums
            hc = h[s:s + rows]
            z = (hc @ weight.t()).to(acc)
            parts, gz = chunk_fn(z, slice(s, s + hc.shape[0]), (need_h or need_w) and hc.shape[0] > 0)
            sums = list(parts) if not sums else [a + b for a, b in zip(sums, parts)]
            if gz is not None:
                gz = gz.to(h.dtype)
                if grad_h is not None:
                    torch.mm(gz, weight, out=grad_h[s:s + rows])
                if grad_w is not None:
                    grad_w.addmm_(gz.t(), hc)
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.has = (need_h, need_w)
        out = finish(*sums) if finish is not None else sums[0]
        if isinstance(out, tuple):
            ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_extra: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = [t * g.to(t.dtype) for t in ctx.saved_tensors]
        gh = saved.pop(0) if ctx.has[0] else None
        gw = saved.pop(0) if ctx.has[1] else None
        return gh, gw, None, None, None


def linear_chunked_loss(h: torch.Tensor, weight: torch.Tensor, rows: int, chunk_fn: Callable[..., Any],
                        finish: Callable[..., Any] | None = None) -> Any:
    """A loss of the logits ``h W^T`` whose gradient is computed chunk by chunk in forward.

    Args:
        h: ``[N, H]`` hidden states; weight: ``[V, H]`` the head's weight; rows: rows per chunk.
        chunk_fn: ``(z, rows, need_grad) -> (parts, dz)``: ``z`` is the chunk's ``[n, V]`` logits in
            float32 (float64 for float64 ``h``; it may be overwritten), ``rows`` the chunk's slice of the
            ``N`` positions; ``parts`` a tuple of scalar tensors, summed over chunks; ``dz`` the gradient of
            the returned loss w.r.t. ``z`` (``None`` when ``need_grad`` is false).
        finish: ``(*sums) -> loss`` or ``(loss, *extras)`` (extras not differentiable); default: the one sum.

    Backward scales the gradients computed in forward: ``dz`` must be that of ``finish``'s loss.
    """
    return _LinearChunkedLoss.apply(h, weight, rows, chunk_fn, finish)


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Scalar ``sum_n -log softmax(h_n W^T)[y_n]`` (float32).

    Args:
        h: ``[N, H]`` hidden states at the supervised positions.
        weight: ``[V, H]`` the LM head's weight.
        targets: ``[N]`` the token each position must predict.
    """
    def chunk(z: torch.Tensor, sl: slice, need_grad: bool) -> tuple[tuple[torch.Tensor], torch.Tensor | None]:
        tc = targets[sl]
        lse = torch.logsumexp(z, dim=-1)
        loss = (lse - z.gather(-1, tc.unsqueeze(-1)).squeeze(-1)).sum()
        if not need_grad:
            return (loss,), None
        p = z.sub_(lse.unsqueeze(-1)).exp_()  # softmax, in place over the chunk's logits
        p[torch.arange(p.shape[0], device=p.device), tc] -= 1.0
        return (loss,), p

    return linear_chunked_loss(h, weight, chunk_rows(weight.shape[0], chunk_elements), chunk)


def sft_loss_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                         loss_mask: torch.Tensor, *, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """:func:`kiln.training.losses.sft.sft_loss` from hidden states, logits only at the supervised positions.

    Args:
        hidden: ``[B, T, H]`` final-norm hidden states.
        weight: ``[V, H]`` LM head weight.
        input_ids: ``[B, T]``.
        loss_mask: ``[B, T]``; 1 on target tokens (position 0 is never a target).

    Returns: the token-level mean cross-entropy over the targets (same definition as ``sft_loss``).
    """
    target_mask = loss_mask[:, 1:].bool()
    count = int(target_mask.sum())
    if count == 0:
        raise ValueError("sft_loss: the batch has no target tokens (empty loss mask)")
    rows, cols = target_mask.nonzero(as_tuple=True)
    h = hidden[rows, cols]  # position t predicts token t+1
    targets = input_ids[rows, cols + 1]
    return linear_cross_entropy_sum(h, weight, targets, chunk_elements=chunk_elements) / count


def _logprob_chunk(hc: torch.Tensor, weight: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
    z = (hc @ weight.t()).float()
    return z.gather(-1, tc.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def linear_token_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``[N]`` float32 ``log softmax(h_n W^T)[y_n]``; one chunk of logits alive at a time.

    With gradients on, each chunk is recomputed in backward instead of kept.
    """
    rows = chunk_rows(weight.shape[0], chunk_elements)
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    out = []
    for s in range(0, h.shape[0], rows):
        args = (h[s:s + rows], weight, targets[s:s + rows])
        out.append(checkpoint(_logprob_chunk, *args, use_reentrant=False) if grad else _logprob_chunk(*args))
    return torch.cat(out) if out else h.new_zeros((0,), dtype=torch.float32)
