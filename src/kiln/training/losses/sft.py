"""The SFT loss: masked next-token cross-entropy over full logits.

Shapes: ``B`` batch rows, ``T`` sequence length, ``V`` vocabulary size. Masks are ``bool`` or
``0/1`` tensors; padded positions carry 0. The chunked form that never builds ``[B, T, V]`` is
:func:`kiln.training.losses.chunked.sft_loss_from_hidden`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shifted_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability the model gives each next token.

    Args:
        logits: ``[B, T, V]`` model outputs for ``input_ids``.
        input_ids: ``[B, T]`` token IDs.

    Returns:
        ``[B, T-1]``: entry ``t`` is ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``.
    """
    logp = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens selected by ``loss_mask``.

    Args:
        logits: ``[B, T, V]``.
        input_ids: ``[B, T]``.
        loss_mask: ``[B, T]``; 1 where the token is a training target (assistant
            tokens). Position 0 can never be a target (nothing predicts it).

    Returns:
        Scalar: the sum of ``-log p(token)`` over masked target tokens divided by
        their count (token-level mean across the whole batch, so long and short
        examples weigh by their token count).
    """
    # Shift the labels, not the logits: the target of position t is token t+1, and
    # the last position has none. Slicing the logits would copy the whole [B, T, V].
    labels = torch.where(loss_mask.bool(), input_ids, IGNORE_INDEX)
    labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    count = (labels != IGNORE_INDEX).sum()
    if count.item() == 0:
        raise ValueError("sft_loss: the batch has no target tokens (empty loss mask)")
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / count
