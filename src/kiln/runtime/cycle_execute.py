"""The *execute* step of an engine cycle: a :class:`~kiln.runtime.cycle_plan.CyclePlan`'s forwards, run
under shared accelerator ownership and inference mode, returned as a frozen :class:`ForwardOutput`.

Execute reads rows and writes only this cycle's KV slots (positions no row has claimed yet): it never
advances a row, publishes a block or samples a token (that is :mod:`kiln.runtime.cycle_update`). So a
forward that raises leaves every row as it was before the cycle, which is what lets
:mod:`kiln.runtime.cycle_faults` run the same rows again in smaller plans.

Generation rows go into one packed forward when :meth:`~kiln.runtime.batches.Batches.packable`
allows it, else a decode forward and a prefill forward; scoring rows into one prefill forward that
keeps every position's logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kiln.runtime.adapter_slots import AdapterSlots
from kiln.runtime.batches import Batches
from kiln.runtime.cycle_faults import FaultHook
from kiln.runtime.cycle_plan import CyclePlan
from kiln.runtime.ownership import AcceleratorOwnership
from kiln.runtime.rows import Row
from kiln.runtime.threads import torch_threads


@dataclass(frozen=True)
class ForwardOutput:
    """What one cycle's forwards returned.

    ``decode_logits`` ``[len(plan.decoding), vocab]`` (None without decoding rows); ``prompt_logits``
    ``[len(completing), vocab]`` at the last prompt token of the generation rows whose prefill completes
    this cycle, ``completing`` (in the plan's prompt order); ``score_logits`` ``[len(plan.scoring), width,
    vocab]`` for every chunk position of the scoring rows (row ``i``'s first ``c_i`` are real).
    ``forward_s``: seconds inside the forwards; ``lock_wait_s``: how long the cycle waited for an
    exclusive owner (a training step, an adapter change); ``wide``: whether it ran on more torch threads."""

    decode_logits: torch.Tensor | None
    prompt_logits: torch.Tensor | None
    completing: tuple[Row, ...]
    score_logits: torch.Tensor | None
    forward_s: float
    lock_wait_s: float
    wide: bool


class CycleExecutor:
    """Runs plans' forwards (see the module docstring)."""

    def __init__(self, batches: Batches, adapters: AdapterSlots, ownership: AcceleratorOwnership,
                 fault: FaultHook | None = None):
        self.batches = batches
        self.adapters = adapters
        self.ownership = ownership
        self.fault = fault

    def ensure_eval(self) -> None:
        fm = self.adapters.forward_model
        if fm.training:
            fm.eval()

    def __call__(self, plan: CyclePlan) -> ForwardOutput:
        batches = self.batches
        decoding = list(plan.decoding)
        prompts = list(plan.prompts)
        with self.ownership.shared(), torch.inference_mode(), torch_threads(plan.threads) as wide:
            t0 = time.perf_counter()
            waited = self.ownership.last_shared_wait_s()
            self.ensure_eval()
            if self.fault is not None:
                self.fault.before_forward(plan.rows)
            dec = pre = scores = None
            completing: list[Row] = []
            if prompts and batches.packable(decoding, prompts):
                dec, pre, completing = batches.packed(decoding, prompts)
            else:
                if decoding:
                    dec = batches.decode(decoding)
                if prompts:
                    pre, completing = batches.prefill(prompts)
            if plan.scoring:
                scores, _ = batches.prefill(list(plan.scoring), all_logits=True)
            forward_s = time.perf_counter() - t0
        return ForwardOutput(dec, pre, tuple(completing), scores, forward_s, waited, wide)
