"""Key-whitened LoRA (an experiment of bench/locality.py, not used by Kiln's jobs: measured, it did not keep more
of the knowledge world's facts over a chain of corrections; docs/training.md, "What drifts over a long chain").

An adapter's input side moves along the directions the base model's inputs rarely use.

A gradient step on one correction moves a LoRA ``A`` along that example's layer inputs (``dA ~ g x^T``); every
other input ``k`` then changes by ``dA k ~ g (x . k)``. Inputs share a few strong directions (the mean of the
residual stream, the MLP's common activations), so ``x . k`` is large for almost every ``k`` and one correction
moves everything a little; over a chain of corrections that drift adds up (docs/training.md, "What drifts over a
long chain"). Rank-one editors avoid it by weighting the update with the inverse of the inputs' second moment
``C = E[k k^T]`` (ROME/MEMIT's ``C^-1 k``): the edit then lives in the directions that tell this input apart.

Here the same idea is a reparametrization of each LoRA ``A`` of the job's adapter: ``A = A' D V^T``, with
``C / mean_eig(C) = V diag(e) V^T`` measured on the base model's inputs (all adapters disabled) over rows the
job does not train on (the anchor's rows: the base's own questions and answers), and
``D = diag(sqrt(damping / (e + damping)))``: 1 along directions the base rarely uses, down to
``sqrt(damping / e)`` along the common ones. The optimizer steps ``A'`` in those eigen-coordinates (AdamW's
per-coordinate steps are then per input direction); :func:`bake` folds ``D V^T`` back into a plain ``A`` before
the adapter is read, saved or served, so a whitened adapter is a standard PEFT LoRA.

Call :func:`whiten` before the job's loop collects the adapter's parameters (it replaces ``A``'s parameter) and
:func:`bake` when the loop ends, both under exclusive ownership.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.training.core.data import Row, collate

# how much of the mean eigenvalue a direction keeps full speed below (smaller: stronger whitening)
DEFAULT_DAMPING = 0.1


def lora_layers(peft_model: Any, name: str) -> dict[str, Any]:
    """The LoRA layers that carry adapter ``name``, by module name."""
    out = {}
    for mod_name, mod in peft_model.named_modules():
        lora_a = getattr(mod, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and name in lora_a and hasattr(mod, "base_layer"):
            out[mod_name] = mod
    return out


def input_moments(peft_model: Any, layers: dict[str, Any], rows: Sequence[Row], *, pad_id: int,
                  batch_size: int = 16) -> dict[str, torch.Tensor]:
    """``E[x x^T]`` of each layer's input over the real tokens of ``rows``, the base model's (adapters disabled)."""
    device = next(peft_model.parameters()).device
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    keep: list[torch.Tensor] = []

    def hook(mod_name: str) -> Any:
        def capture(_mod: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().float()
            x = x.reshape(-1, x.shape[-1])[keep[0]]
            acc = sums.get(mod_name)
            sums[mod_name] = x.T @ x if acc is None else acc + x.T @ x
            counts[mod_name] = counts.get(mod_name, 0) + x.shape[0]
        return capture

    handles = [layer.base_layer.register_forward_pre_hook(hook(n)) for n, layer in layers.items()]
    try:
        with torch.no_grad(), peft_model.disable_adapter():
            for i in range(0, len(rows), batch_size):
                batch = collate(rows[i:i + batch_size], pad_id, device)
                keep[:] = [batch["attention_mask"].reshape(-1).bool()]
                peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / max(1, counts[n]) for n in sums}


class _Whitened(torch.nn.Module):
    """``A = A' M`` with ``M = D V^T`` (a parametrization of ``lora_A.weight``)."""

    def __init__(self, m: torch.Tensor, m_inv: torch.Tensor):
        super().__init__()
        self.register_buffer("m", m)
        self.register_buffer("m_inv", m_inv)

    def forward(self, a_prime: torch.Tensor) -> torch.Tensor:
        return a_prime @ self.m

    def right_inverse(self, a: torch.Tensor) -> torch.Tensor:
        return a @ self.m_inv


def whitening(moment: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, M^-1)`` for one layer's input second moment."""
    c = moment.double()
    c = c / c.diagonal().mean().clamp(min=1e-12)
    e, v = torch.linalg.eigh(c)
    d = (damping / (e.clamp(min=0.0) + damping)).sqrt()
    return (d[:, None] * v.T).float(), (v / d[None, :]).float()


def whiten(peft_model: Any, name: str, rows: Sequence[Row], *, pad_id: int,
           damping: float = DEFAULT_DAMPING) -> int:
    """Reparametrize every ``lora_A`` of adapter ``name`` by the whitening of its inputs over ``rows``; returns
    how many layers were whitened (0 when ``rows`` is empty). The adapter's current weights are kept."""
    from torch.nn.utils import parametrize

    layers = lora_layers(peft_model, name)
    if not rows or not layers:
        return 0
    moments = input_moments(peft_model, layers, rows, pad_id=pad_id)
    for mod_name, layer in layers.items():
        lin = layer.lora_A[name]
        m, m_inv = whitening(moments[mod_name].to(lin.weight.device), damping)
        requires_grad = lin.weight.requires_grad
        parametrize.register_parametrization(lin, "weight", _Whitened(m, m_inv))
        lin.parametrizations.weight.original.requires_grad_(requires_grad)
    return len(layers)


def bake(peft_model: Any, name: str) -> None:
    """Fold the whitening back into plain ``lora_A`` weights (a no-op for an adapter that is not whitened)."""
    from torch.nn.utils import parametrize

    for layer in lora_layers(peft_model, name).values():
        lin = layer.lora_A[name]
        if parametrize.is_parametrized(lin, "weight"):
            parametrize.remove_parametrizations(lin, "weight", leave_parametrized=True)
