"""One sparse-KD batch: the tensors a batch of forward windows becomes, and the loss of one step.

A window (:func:`kiln.distill.examples.forward_windows`) is a row of tokens with the places where the
teacher's sparse distribution was recorded; :func:`batch_tensors` pads the rows and gathers, per place,
the selected IDs (top-k plus the forced token), their logprobs, the tail mass and the CE target.
:func:`kd_step_loss` computes :class:`kiln.training.losses.kd.SparseKDLoss` on them, from the full logits
or (with the LoRA head split, :func:`kd_loss_split`) a chunk of rows at a time. Used by the offline
trainer (:mod:`kiln.distill.train`) and the server's KD job (:mod:`kiln.training.kd.job`).
"""

from __future__ import annotations


def batch_tensors(batch, examples, k: int, vocab: int, device: str, ce: bool):
    import numpy as np
    import torch

    width = max(len(w) for w, _p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    att = torch.zeros((len(batch), width), dtype=torch.long)
    for r, (w, _p) in enumerate(batch):
        ids[r, : len(w)] = torch.tensor(w)
        att[r, : len(w)] = 1
    rows, offs, sel_ids, sel_lp, sel_mask, tail, target = [], [], [], [], [], [], []
    for r, (_w, places) in enumerate(batch):
        for off, n, i in places:
            e = examples[n]
            rows.append(r)
            offs.append(off)
            tok = int(e.forced[i])
            flp = float(e.forced_logprobs[i])
            has_forced = k < vocab and not np.isnan(flp)
            sel_ids.append(list(e.top_ids[i]) + [tok])
            sel_lp.append(list(e.top_logprobs[i]) + [flp if has_forced else 0.0])
            sel_mask.append([True] * k + [has_forced])
            tail.append(float(e.tail[i]))
            target.append(tok if ce else -100)
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return (
        ids.to(device),
        att.to(device),
        t(rows, torch.long),
        t(offs, torch.long),
        t(sel_ids, torch.long),
        t(sel_lp, torch.float64),  # stored widths up to float64; the loss casts to the logits' dtype
        t(sel_mask, torch.bool),
        t(tail, torch.float64),
        t(target, torch.long),
    )


def kd_loss_split(model):
    """The LM head split (``chunked_loss.SplitLM``) a KD step uses, or ``None`` for the full-logits path
    (full fine-tuning, or a model whose head is not a plain linear map of the trunk's hidden states)."""
    from kiln.training.losses.chunked import split_causal_lm

    return split_causal_lm(model) if hasattr(model, "base_model") and hasattr(model, "peft_config") else None


def kd_step_loss(model, split, loss_fn, ids, att, rows, offs, sel, lp, mask, tail, target):
    """Sparse-KD loss of one batch: with ``split``, from hidden states at the captured positions and the
    head applied a chunk of rows at a time (no ``[B, T, V]`` or ``[N, V]`` logits kept); else from logits."""
    if split is None:
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[rows, offs]
        return loss_fn(logits, sel, lp, mask, tail, target)
    from kiln.training.losses.kd import linear_sparse_kd

    h = split.hidden(ids, att)[rows, offs]
    return linear_sparse_kd(h, split.head.weight, sel, lp, mask, tail, target, ce_weight=loss_fn.ce_weight,
                            kd_weight=loss_fn.kd_weight, temperature=loss_fn.temperature)
