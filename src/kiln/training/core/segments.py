"""One piece of a training step across several short exclusive holds: cuts inside a row (issue 47).

A step's pieces (:class:`kiln.training.core.loop.Piece`) never cut a row, and one ~200-token row's
forward and backward on a 31M model held the device ~0.33 s, far over ``training.max_hold_ms``.
:class:`LayerHolds` runs one piece's forward and backward decoder layer by decoder layer, and lets
serving run between them whenever the hold has used its budget:

* **Forward.** A pre-hook on every decoder layer (the trainer's thread only; serving's forwards between
  holds pass through it untouched) replaces the layer's input hidden states ``x`` with a leaf
  ``x.detach().requires_grad_()``, remembers ``(x, leaf)``, and, when the layer would not fit in what is
  left of the hold's budget, releases ownership and takes it again (the pacer leaves serving its share
  in between). The activations stay alive across holds exactly as in one hold.
* **Backward.** ``loss.backward()`` runs the head, the final norm and the last layer down to its leaf;
  then each boundary, last to first, ``x.backward(leaf.grad)``, a hold ending between two of them when
  the next would not fit. Every consumer of ``leaf`` (only its own layer: decoder layers pass nothing
  but the hidden states) is behind it by then, so ``leaf.grad`` is the whole ``dL/dx`` and the
  parameters' gradients are those of one ``loss.backward()`` (up to float summation order:
  ``tests/training/test_sliced_steps.py``).

Hooks and the kind's ``around()`` (its checkpointed layer forwards) are installed only while a hold is
held, so serving's forwards (a compiled decode step included) never see them. Layers of other classes
(a decoder layer that hands a layer after it anything besides the hidden states) are not cut: the
piece is one hold, as before. What serving does between two holds never writes the tensors the
graph kept (the base weights, the private adapter); if anything did, autograd's version check would
refuse the backward rather than compute a wrong gradient.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

# Decoder layers whose only input from the layer before is the hidden states (position embeddings and
# masks carry no gradient), so cutting the graph between two of them is exact.
CUTTABLE_LAYERS = frozenset({
    "Qwen3DecoderLayer", "Qwen2DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer",
    "Qwen3_5DecoderLayer",
})
EMA = 0.25  # weight of the newest measurement in the per-unit time estimates
UNITS = ("forward", "head", "first_backward", "backward")  # a layer's forward, the head and loss after the last
# layer, the backward from the loss down to the last layer's input, one more layer's backward
T = TypeVar("T")


def cuttable_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers when a piece can be cut between them; empty when it cannot."""
    from kiln.training.core.step import decoder_layers

    try:
        layers = list(decoder_layers(model))
    except ValueError:
        return []
    return layers if all(type(layer).__name__ in CUTTABLE_LAYERS for layer in layers) else []


class LayerHolds:
    """Runs pieces (``weight * loss()``, forward and backward) as a sequence of holds of at most ``budget()``
    seconds each where a decoder layer fits in it (one layer is never cut).

    ``open_hold()`` takes one exclusive hold (ownership, the private adapter trainable, the kind's trunk
    options); ``budget()`` is the seconds one hold may take now (None: serving is idle, no cut). The work
    between two yield points is timed (a running estimate per kind of unit: a layer's forward, the head
    after the last layer, the first backward from the loss, a layer's backward); a hold ends before a unit
    that would not fit in what is left of the budget, never before its first unit."""

    def __init__(self, layers: Sequence[nn.Module], open_hold: Callable[[], AbstractContextManager[Any]],
                 budget: Callable[[], float | None], clock: Callable[[], float] = time.perf_counter):
        self.layers, self.open_hold, self.budget, self.clock = list(layers), open_hold, budget, clock
        self.estimate_s = dict.fromkeys(UNITS, 0.0)  # seconds per unit, measured
        self.holds = 0  # holds taken by run() and forward(): one per call when nothing was cut
        self._owner = 0
        self._stack: ExitStack | None = None
        self._handles: list[Any] = []
        self._boundaries: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._started = self._held = 0.0
        self._budget: float | None = None  # this hold's budget
        self._unit: tuple[str, float] | None = None  # the forward unit running now and when it started
        self._fresh = True  # nothing has run in this hold yet (it never ends empty)

    # ------------------------------------------------------------------ holds

    def _enter(self) -> None:
        stack = ExitStack()
        stack.enter_context(self.open_hold())
        self._stack = stack
        self._handles = [layer.register_forward_pre_hook(self._pre_hook, with_kwargs=True) for layer in self.layers]
        self._handles.append(self.layers[-1].register_forward_hook(self._last_layer_done))
        self.holds += 1
        self._fresh = True
        self._budget = self.budget()  # read once per hold (the pacer asks the engine whether serving is busy)
        self._started = self.clock()

    def _leave(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._held += self.clock() - self._started
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _start(self, unit: str) -> None:
        """Before a unit of work: end this hold and take the next one unless the unit fits in what is left."""
        if not self._fresh:
            if self._budget is None:  # serving was idle when the hold began: a chat may have arrived since
                self._budget = self.budget()
            budget = self._budget
            if budget is not None and self.clock() - self._started + self.estimate_s[unit] > budget:
                self._leave()
                self._enter()
        self._fresh = False

    def _measure(self, unit: str, took: float) -> None:
        old = self.estimate_s[unit]
        self.estimate_s[unit] = took if old <= 0 else (1 - EMA) * old + EMA * took

    def _forward_unit(self, unit: str | None) -> None:
        """One forward unit ends (the one before, timed) and ``unit`` starts (None: the forward is over)."""
        now = self.clock()
        if self._unit is not None:
            self._measure(self._unit[0], now - self._unit[1])
        if unit is None:
            self._unit = None
            return
        self._start(unit)
        self._unit = (unit, self.clock())

    # ------------------------------------------------------------------ forward hooks (the trainer's thread only)

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if threading.get_ident() != self._owner:
            return None  # serving's forward (never while a hold is held: belt and braces)
        self._forward_unit("forward")
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or not x.requires_grad or not torch.is_grad_enabled():
            return None
        leaf = x.detach().requires_grad_()
        self._boundaries.append((x, leaf))
        if args:
            return (leaf, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": leaf}

    def _last_layer_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == self._owner:
            self._forward_unit("head")  # the final norm, the head and the loss, until the caller's code returns

    # ------------------------------------------------------------------ calls

    def forward(self, fn: Callable[[], T]) -> T:
        """``fn()`` (forwards without gradients: log-probs, a learned check) with holds ending between layers."""
        self._owner, self._held, self._unit = threading.get_ident(), 0.0, None
        self._enter()
        try:
            return fn()
        finally:
            self._unit = None
            self._leave()

    def run(self, loss_of: Callable[[], torch.Tensor], weight: float,
            check: Callable[[torch.Tensor], None] = lambda loss: None) -> tuple[float, float]:
        """``(weight * loss_of()).backward()`` across holds; returns (the weighted loss, seconds held).
        ``check(loss)`` runs before the backward (it raises on a loss that must not be applied)."""
        self._owner, self._held, self._boundaries, self._unit = threading.get_ident(), 0.0, [], None
        self._enter()
        try:
            loss = loss_of() * weight
            self._forward_unit(None)
            check(loss)
            self._timed_backward("first_backward", loss, None)
            boundaries, self._boundaries = self._boundaries, []
            for x, leaf in reversed(boundaries):
                grad, leaf.grad = leaf.grad, None
                if grad is not None:  # None: nothing after this layer reached the loss
                    self._timed_backward("backward", x, grad)
            value = float(loss.detach())
        finally:
            self._boundaries, self._unit = [], None
            self._leave()
        return value, self._held

    def _timed_backward(self, unit: str, tensor: torch.Tensor, grad: torch.Tensor | None) -> None:
        self._start(unit)
        t0 = self.clock()
        torch.autograd.backward(tensor, grad)
        self._measure(unit, self.clock() - t0)

    def cuts(self) -> float:
        """How many holds one piece's forward and backward can be cut into at best: its measured units'
        total over the longest unit (1.0 until every kind of unit has been timed)."""
        e, n = self.estimate_s, len(self.layers)
        if min(e.values()) <= 0:
            return 1.0
        total = n * e["forward"] + e["head"] + e["first_backward"] + (n - 1) * e["backward"]
        return max(1.0, total / max(e.values()))

    def snapshot(self) -> dict[str, float | int]:
        """The holds taken and each unit's estimated milliseconds (a job's progress: ``layer_holds``)."""
        return {"holds": self.holds, **{f"{k}_ms": round(1000 * v, 2) for k, v in self.estimate_s.items()}}
