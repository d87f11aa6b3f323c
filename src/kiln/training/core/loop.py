"""The shared training loop: optimizer, cancel, checkpoints, progress and the learned check.

The model being trained is the engine's own ``PeftModel``: the job adds a
private adapter to it (:mod:`kiln.training.core.lora`), and every optimizer step
runs inside ``exclusive()`` (the accelerator-ownership lock) with that adapter
active, then hands the model back to serving. Serving names its adapter per row,
so the private adapter is never applied to a request; the previously active
adapter is put back when the loop ends.

Batches are right-padded and the forward passes no attention mask: under causal
attention a real token never sees the padding after it, so its logits equal
those of the unpadded row (up to float rounding), and padded positions carry no
loss. Without a mask the attention kernel keeps its plain causal path.

Each job kind (:mod:`kiln.training.sft.job`, :mod:`kiln.training.grpo.job`, ...) reads top to
bottom: build the loop, restore a checkpoint if given, then
``for batch: forward -> loss -> backward -> step``.

While serving is busy a step need not be one hold: the hooks' ``hold_budget`` gives the seconds one
hold may take, and a kind that passes a slicer to :meth:`TrainLoop.train` has its step cut into
:class:`Piece` s (row micro-batches, the anchor rows) whose weighted losses sum to the step's loss.
Each piece's forward and backward is one hold (gradients accumulate in the adapter's ``.grad``),
the optimizer step another; serving runs between them. The gradients are those of the whole step
(up to float summation order): every loss here is a token mean, and a piece of ``n`` of the step's
``N`` loss tokens weighs ``n / N``. A piece is cut further, between its decoder layers (forward and
backward, :class:`kiln.training.core.segments.LayerHolds`), so one long row is several holds too.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch

from kiln.training.core.checkpoints import Checkpoint, save_checkpoint
from kiln.training.core.data import Row, collate, collate_packed, epoch_order
from kiln.training.core.errors import JobCancelled, TrainingFailed
from kiln.training.core.lora import adapter_state, make_trainable, private_parameters, release_private
from kiln.training.core.segments import LayerHolds, cuttable_layers
from kiln.training.losses.chunked import chunk_rows, split_causal_lm

PROGRESS_EVERY_S = 0.25
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """Everything that determines the arithmetic of a run (hashed for resume)."""

    learning_rate: float
    epochs: int
    batch_size: int
    seed: int
    checkpoint_interval: int = 0
    max_steps: int | None = None  # cap on optimizer steps (None: epochs x batches)
    until_learned: "LearnedCheck | None" = None  # SFT: stop once the targets are the greedy answer
    # How each step is computed (see :class:`StepOptions`); recorded in checkpoints, and a resume with
    # other values is refused. Default off: callers that predate them compute exactly what they did.
    packing: bool = False  # SFT: pack a batch's rows into fewer sequences when that removes padding
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward instead of keeping activations
    compile: bool = False  # torch.compile the trunk (static shapes per length bucket)
    weight_decay: float = 0.0  # AdamW's decoupled decay: pulls the adapter towards zero (the base) every step

    def step_options(self) -> dict[str, bool]:
        """The settings that change a step's float arithmetic but not what it computes."""
        return {"packing": self.packing, "gradient_checkpointing": self.gradient_checkpointing,
                "compile": self.compile}


@dataclass(frozen=True)
class LearnedCheck:
    """Stop SFT once every assistant token is the model's greedy choice by ``margin`` (logits).

    Under teacher forcing, "the target token is the argmax at every assistant
    position" is exactly "greedy decoding reproduces every assistant turn"
    (through its end-of-turn token). The margin makes that robust to the small
    numerical differences between this forward pass and the serving path
    (KV cache, batch shapes, another CPU's kernels).
    """

    every: int = 5
    margin: float = 1.0


@dataclass
class Hooks:
    """How the loop talks to the outside world; defaults make it self-contained."""

    exclusive: Callable[[], AbstractContextManager[Any]] = nullcontext
    should_cancel: Callable[[], bool] = lambda: False
    on_progress: Callable[[dict[str, Any]], None] = lambda p: None
    checkpoint_root: Path | None = None
    plan_sha256: str = ""
    # seconds one exclusive hold may take now (serving is waiting), None: no bound (kiln.runtime.ownership.HoldPacer)
    hold_budget: Callable[[], float | None] = lambda: None
    # the configured longest hold (training.max_hold_ms) in seconds whether serving waits or not; None: slicing off
    max_hold: Callable[[], float | None] = lambda: None
    # while a hold is bounded, cut a piece between decoder layers too (kiln.training.core.segments; training.layer_holds)
    layer_holds: bool = True


@dataclass
class Report:
    steps: int
    total_steps: int
    final_loss: float
    tokens: int
    train_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "total_steps": self.total_steps,
            "final_loss": self.final_loss,
            "tokens": self.tokens,
            "train_seconds": round(self.train_seconds, 4),
            "tokens_per_s": round(self.tokens / self.train_seconds, 2) if self.train_seconds > 0 else None,
            **self.extra,
        }


# ------------------------------------------------------------------ shared loop


def _adamw(params: Sequence[torch.nn.Parameter], lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW, fused where this torch supports it for these parameters (one kernel for all
    adapter tensors: 1.7 -> 0.3 ms per step for the 64 LoRA tensors of the 31M bench shape)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@dataclass(frozen=True)
class StepInput:
    """One optimizer step as a kind's batches yield it to :meth:`TrainLoop.train`."""

    batch: Any  # what the kind's loss step reads; None: no update this time (the cursor still moves)
    tokens: int = 0  # the real tokens it trains on (tokens/s)
    cursor: tuple[int, int] = (0, 0)  # (epoch, batch) after this step: where a resume starts
    tensors: dict[str, torch.Tensor] | None = None  # the kind's state a checkpoint after this step carries
    after: Callable[[], None] | None = None  # the kind's bookkeeping after the update (its stats in progress)


@dataclass(frozen=True)
class Piece:
    """One slice of a step's loss: ``weight * loss()``, run as one exclusive hold (forward and backward).

    A step's pieces sum to its loss; ``tokens`` (the real tokens it runs) sizes it against the hold budget."""

    loss: Callable[[], torch.Tensor]
    weight: float
    tokens: int


# A kind's slicer: (a step's batch, the most tokens one piece should run) -> the step's pieces. It may return
# one piece (nothing to cut); a single row is never cut, so a piece can exceed the limit.
Slicer = Callable[[Any, int], Sequence[Piece]]


def row_groups(tokens: Sequence[int], limit: int) -> list[range]:
    """Consecutive rows grouped so each group's ``tokens`` stay within ``limit`` (a row alone may exceed it)."""
    groups: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(tokens):
        if i > start and total + n > limit:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if len(tokens) > start:
        groups.append(range(start, len(tokens)))
    return groups


def sub_batch(batch: dict[str, torch.Tensor], rows: range) -> dict[str, torch.Tensor]:
    """Rows ``rows`` of a right-padded collated batch (every ``[N, T]`` tensor), the columns after its longest
    real row dropped (causal attention: padding after a row cannot change it)."""
    attn = batch["attention_mask"][rows.start:rows.stop]
    real = attn.any(0).nonzero()
    width = int(real[-1]) + 1 if real.numel() else attn.shape[1]
    out: dict[str, torch.Tensor] = {}
    for k, v in batch.items():
        if v.dim() == 2 and v.shape[0] == batch["input_ids"].shape[0]:
            out[k] = v[rows.start:rows.stop, :width]
        elif v.dim() >= 1 and v.shape[0] == batch["input_ids"].shape[0]:
            out[k] = v[rows.start:rows.stop]
        else:
            out[k] = v
    return out


def token_mean_pieces(batch: dict[str, torch.Tensor], limit: int, loss: Callable[[dict[str, torch.Tensor]], torch.Tensor]
                      ) -> list[Piece]:
    """Pieces of a token-mean loss over ``batch``'s ``loss_mask[:, 1:]`` tokens: row groups within ``limit`` real
    tokens, each weighted by its share of the loss tokens (groups with none are left out: they add nothing)."""
    per_row = batch["loss_mask"][:, 1:].sum(1).tolist()
    total = sum(per_row)
    real = batch["attention_mask"].sum(1).tolist()
    pieces = []
    for g in row_groups(real, limit):
        n = sum(per_row[i] for i in g)
        if n:
            pieces.append(Piece(partial(loss, sub_batch(batch, g)), n / total, int(sum(real[i] for i in g))))
    return pieces


@dataclass(frozen=True)
class Learned:
    """A kind's learned check: ``check()`` after every ``every``-th step; the job stops once it holds.

    With ``final`` it runs once more after the last step when it never held (SFT)."""

    every: int
    check: Callable[[], bool]
    final: bool = False


class TrainLoop:
    """One job's training loop: the optimizer and counters, exclusive ownership per step, cancel,
    checkpoints and resume, progress and the learned check.

    A kind composes it: it yields :class:`StepInput` s (its batches, prepared outside ownership) and
    gives a loss step (batch -> loss) to :meth:`train`. Kinds whose steps do not fit that shape
    (sparse KD's ledger, torchrun's micro-batches) use the same pieces directly."""

    def __init__(self, peft_model: Any, name: str, plan: Plan, hooks: Hooks, total_steps: int,
                 resume: Checkpoint | None):
        self.peft_model, self.name, self.plan, self.hooks = peft_model, name, plan, hooks
        self.total_steps = total_steps if plan.max_steps is None else min(total_steps, plan.max_steps)
        self.params = private_parameters(peft_model, name)
        self.device = self.params[0].device
        self.previous = peft_model.active_adapter
        self.opt = _adamw(self.params, plan.learning_rate, plan.weight_decay)
        self.step, self.epoch, self.batch = 0, 0, 0
        self.tokens, self.train_s, self.loss = 0, 0.0, float("nan")
        self.stats: dict[str, Any] = {}
        self.last_step_s = 0.0  # the last update's seconds under exclusive ownership (train)
        self.s_per_token = 0.0  # forward+backward seconds per token, measured (sizes pieces to the hold budget)
        self.tokens_in_step = 0  # a sliced step's tokens whose pieces are done (progress while the step runs)
        self.split_idle = False  # the step under way was split with serving idle (Loop.pieces)
        self._last_progress = 0.0
        # a compiled trunk runs its layers inside one graph: no hooks between them, pieces stay whole
        layers = cuttable_layers(peft_model) if hooks.layer_holds and not plan.compile else []
        self.layer_holds = LayerHolds(layers, nullcontext, hooks.hold_budget) if layers else None
        if resume is not None:
            self._restore(resume)

    def _restore(self, ckpt: Checkpoint) -> None:
        from peft import set_peft_model_state_dict

        # Checkpoints written before these options existed computed every step with all of them off.
        saved = {k: False for k in self.plan.step_options()} | dict(ckpt.stats.get("step_options") or {})
        changed = [f"{k}={saved[k]} -> {v}" for k, v in self.plan.step_options().items() if saved.get(k) != v]
        if changed:
            raise TrainingFailed(
                f"checkpoint {ckpt.path.name} was written with other step settings ({', '.join(changed)}); "
                "exact resume needs the settings it was written with: resubmit with them"
            )
        set_peft_model_state_dict(self.peft_model, ckpt.adapter_state, adapter_name=self.name)
        self.opt.load_state_dict(ckpt.optimizer_state)
        torch.set_rng_state(ckpt.rng_state)
        self.step, self.epoch, self.batch = ckpt.step, ckpt.epoch, ckpt.batch
        self.tokens = int(ckpt.stats.get("tokens", 0))
        self.train_s = float(ckpt.stats.get("train_s", 0.0))
        self.loss = float(ckpt.stats.get("loss", float("nan")))
        self.stats.update(ckpt.stats.get("extra", {}))
        self.stats["resumed_from_step"] = ckpt.step
        self.checkpoint_step = ckpt.step

    checkpoint_step = 0

    @contextmanager
    def running(self) -> Iterator["TrainLoop"]:
        """Around the whole loop: put the previously active adapter back at the end, whatever happens."""
        try:
            yield self
        finally:
            with self.hooks.exclusive():
                release_private(self.peft_model, self.name, self.previous)

    @contextmanager
    def step_ownership(self) -> Iterator[None]:
        """Exclusive ownership for one step, with the private adapter active and trainable."""
        with self.hooks.exclusive():
            make_trainable(self.peft_model, self.name, self.params)
            yield

    def check_cancel(self) -> None:
        if self.hooks.should_cancel():
            raise JobCancelled(self.step)

    def done(self) -> bool:
        return self.step >= self.total_steps

    def optimizer_step(self, loss: torch.Tensor | float, tokens: int, started: float) -> None:
        """Backpropagate ``loss`` and step the optimizer; a float is the value of a loss the step already
        backpropagated itself (torchrun's micro-batches, :mod:`kiln.training.sft.distributed`)."""
        if isinstance(loss, torch.Tensor):
            if not torch.isfinite(loss):
                raise TrainingFailed(f"loss became {loss.item()} at step {self.step + 1}; lower the learning rate")
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
        self.step += 1
        self.tokens += tokens
        self.train_s += time.perf_counter() - started

    def train(self, steps: Iterable[StepInput], loss_step: Callable[[Any], torch.Tensor | float], *,
              learned: Learned | None = None, around: Callable[[], AbstractContextManager[Any]] = nullcontext,
              at_end: Callable[[], None] | None = None, slicer: Slicer | None = None) -> None:
        """Run ``loss_step`` on each of ``steps`` under exclusive ownership, one optimizer step each, until
        the steps run out, the step cap is reached, the learned check holds or the job is cancelled (checked
        before each step is drawn, so a kind's sampling for the next step does not start). Puts the
        previously active adapter back at the end. ``around`` wraps each step's forward and backward (a
        kind's trunk options); ``at_end`` is the kind's last work before the adapter is released. Records
        ``learned`` (and ``learned_at_step``) in the stats when the kind has a learned check; the kind's
        :meth:`report` follows. ``slicer``: how the kind cuts a step into pieces when holds are bounded
        (:meth:`update`)."""
        with self.running():
            pending = iter(steps)
            while not self.done():
                self.check_cancel()
                s = next(pending, None)
                if s is None:
                    break
                if s.batch is not None:
                    self.update(s, loss_step, around, slicer)
                    if s.after is not None:
                        s.after()
                    if learned is not None and self.step % learned.every == 0 and learned.check():
                        self.stats["learned_at_step"] = self.total_steps = self.step
                self.after_step(*s.cursor, tensors=s.tensors)
            if learned is not None:
                if learned.final and "learned_at_step" not in self.stats and learned.check():
                    self.stats["learned_at_step"] = self.step
                self.stats["learned"] = "learned_at_step" in self.stats
            if at_end is not None:
                at_end()

    def pieces(self, batch: Any, slicer: Slicer | None) -> Sequence[Piece] | None:
        """The step's pieces when the kind can slice; None: one hold for the step (or one piece cut between layers).

        While a hold is bounded, a piece's tokens are sized so that the piece's forward and backward fit in
        as many holds as :class:`LayerHolds` can cut it into (its units' total over the longest), each hold
        about the budget: one whole hold per piece without layer cuts. With serving idle a step is one piece,
        unless one layer unit of the whole step would outlast ``max_hold`` should a chat arrive mid-step:
        then it is split as if the budget were ``max_hold``, so no later hold outgrows it by a whole batch."""
        self.split_idle = False
        if slicer is None:
            return None
        budget = self.hooks.hold_budget()
        idle = budget is None
        if budget is None:
            budget = self.hooks.max_hold() if self.layer_holds is not None else None
            if budget is None or self.s_per_token <= 0:
                return None
        cuts = self.layer_holds.cuts() if self.layer_holds is not None else 1.0
        split = slicer(batch, max(1, int(budget * cuts / self.s_per_token)) if self.s_per_token > 0 else 1)
        if idle:
            self.split_idle = len(split) > 1
            return split if self.split_idle else None
        return split

    def update(self, s: StepInput, loss_step: Callable[[Any], torch.Tensor | float],
               around: Callable[[], AbstractContextManager[Any]] = nullcontext, slicer: Slicer | None = None) -> None:
        """One optimizer step on ``s``: one hold for forward, backward and step; or, when the hold budget asks for
        it and the kind slices, one hold per piece (forward and backward, gradients accumulating) and one
        for the optimizer step. With :class:`LayerHolds` a step begun while serving idles is one piece, cut
        between layers should a chat arrive while it runs (a chat would otherwise wait for the whole step)."""
        pieces = self.pieces(s.batch, slicer)
        sliced = bool(pieces) and not self.split_idle  # cut because serving waited (an idle split is not counted)
        if not pieces and self.layer_holds is not None and slicer is not None:  # a kind that slices: a tensor loss
            pieces = [Piece(partial(loss_step, s.batch), 1.0, s.tokens)]
        if not pieces:
            with self.step_ownership(), around():
                started = time.perf_counter()
                self.optimizer_step(loss_step(s.batch), s.tokens, started)
                self.last_step_s = time.perf_counter() - started
            self._measured(self.last_step_s, s.tokens)
            return
        total, held, done, planned = 0.0, 0.0, 0, sum(p.tokens for p in pieces) or 1
        for piece in pieces:
            value, dt = self.run_piece(piece, around)
            total += value
            held += dt
            self._measured(dt, piece.tokens)
            done += piece.tokens
            self.tokens_in_step = s.tokens * done // planned
            self._progress_due()
        self.tokens_in_step = 0
        with self.step_ownership():
            t0 = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            held += time.perf_counter() - t0
        self.loss = total
        self.step += 1
        self.tokens += s.tokens
        self.train_s += held
        self.last_step_s = held
        if sliced:
            self.stats["sliced_steps"] = int(self.stats.get("sliced_steps", 0)) + 1
        if self.layer_holds is not None:
            self.stats["layer_holds"] = self.layer_holds.snapshot()

    def run_piece(self, piece: Piece, around: Callable[[], AbstractContextManager[Any]] = nullcontext
                  ) -> tuple[float, float]:
        """``(piece.weight * piece.loss()).backward()``: one hold, or, with :class:`LayerHolds`, as many as its
        decoder layers need to keep each within the hold budget. Returns (the weighted loss, seconds held)."""
        def finite(loss: torch.Tensor) -> None:
            if not torch.isfinite(loss):
                self.opt.zero_grad(set_to_none=True)
                raise TrainingFailed(f"loss became {loss.item()} at step {self.step + 1}; lower the learning rate")

        if self.layer_holds is not None:
            self.layer_holds.open_hold = partial(self._piece_hold, around)
            return self.layer_holds.run(piece.loss, piece.weight, finite)
        with self.step_ownership(), around():
            t0 = time.perf_counter()
            loss = piece.loss() * piece.weight
            finite(loss)
            loss.backward()
            return float(loss.detach()), time.perf_counter() - t0

    def forward_holds(self, fn: Callable[[], T]) -> T:
        """``fn()``, work without gradients that runs the model (log-probs, a learned check): one hold, or while
        a hold is bounded, holds that end between decoder layers (:meth:`LayerHolds.forward`)."""
        if self.layer_holds is None:
            with self.step_ownership():
                return fn()
        self.layer_holds.open_hold = self.step_ownership
        return self.layer_holds.forward(fn)

    @contextmanager
    def _piece_hold(self, around: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
        with self.step_ownership(), around():
            yield

    def _measured(self, seconds: float, tokens: int) -> None:
        """Fold one hold's seconds per token into the running estimate (a quarter weight for the newest)."""
        if tokens > 0:
            per = seconds / tokens
            self.s_per_token = per if self.s_per_token <= 0 else 0.75 * self.s_per_token + 0.25 * per

    def checkpoint_due(self) -> bool:
        """A checkpoint is written after this step (every ``checkpoint_interval`` steps, never after the last)."""
        p = self.plan
        return bool(p.checkpoint_interval and self.hooks.checkpoint_root is not None
                    and self.step % p.checkpoint_interval == 0 and self.step < self.total_steps)

    def save(self, next_epoch: int, next_batch: int, tensors: dict[str, torch.Tensor] | None = None, *,
             state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
             extra: dict[str, Any] | None = None, step_options: bool = True) -> Path:
        """Write a checkpoint of this step (the adapter, the optimizer, the RNG, the cursor, the stats) to
        ``hooks.checkpoint_root``. ``state``: (adapter weights, optimizer state) gathered by the caller
        (FSDP); ``extra``: the stats to record instead of the loop's."""
        assert self.hooks.checkpoint_root is not None
        weights, opt = state if state is not None else (adapter_state(self.peft_model, self.name),
                                                        self.opt.state_dict())
        stats = {"tokens": self.tokens, "train_s": self.train_s, "loss": self.loss,
                 "extra": self.stats if extra is None else extra}
        if step_options:
            stats["step_options"] = self.plan.step_options()
        return save_checkpoint(self.hooks.checkpoint_root, step=self.step, epoch=next_epoch, batch=next_batch,
                               plan_sha256=self.hooks.plan_sha256, adapter_state=weights, optimizer_state=opt,
                               tensors=tensors, stats=stats)

    def after_step(self, next_epoch: int, next_batch: int, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Move the cursor; write a checkpoint when one is due; report progress (at most every
        ``PROGRESS_EVERY_S``, and after the last step)."""
        self.epoch, self.batch = next_epoch, next_batch
        if self.checkpoint_due():
            self.save(next_epoch, next_batch, tensors)
            self.checkpoint_step = self.step
        self._progress_due(self.step == self.total_steps)

    def _progress_due(self, force: bool = False) -> None:
        """Report progress when ``PROGRESS_EVERY_S`` has passed since the last report (or ``force``)."""
        now = time.perf_counter()
        if now - self._last_progress >= PROGRESS_EVERY_S or force:
            self._last_progress = now
            self.hooks.on_progress(self.progress())

    def progress(self) -> dict[str, Any]:
        per_step = self.train_s / self.step if self.step else None
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.epoch,
            "loss": None if math.isnan(self.loss) else round(self.loss, 6),
            "tokens_per_s": round(self.tokens / self.train_s, 1) if self.train_s > 0 else None,
            "tokens": self.tokens,  # trained so far: tokens per wall second from two reads (bench/serve_while_training.py)
            "tokens_in_step": self.tokens_in_step,  # of the step running now (sliced), its pieces' done so far
            "eta_s": round(per_step * (self.total_steps - self.step), 2) if per_step is not None else None,
            "checkpoint_step": self.checkpoint_step,
            **self.stats,
        }

    def report(self) -> Report:
        return Report(self.step, self.total_steps, self.loss, self.tokens, self.train_s, dict(self.stats))


# ------------------------------------------------------------ learned check


def greedy_margin(peft_model: Any, rows: Sequence[Row], *, pad_id: int, batch_size: int,
                  packing: bool = False) -> float:
    """The smallest ``logit(target) - max(logit(other))`` over all loss-masked tokens of ``rows``.

    Positive means greedy decoding reproduces every target (see :class:`LearnedCheck`).
    With ``packing`` (and a split head) each batch's rows are packed as in training.
    """
    device = next(peft_model.parameters()).device
    worst = math.inf
    split = split_causal_lm(peft_model)
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            if split is not None:  # logits only at the target positions, a chunk at a time
                batch = (collate_packed if packing else collate)(rows[i:i + batch_size], pad_id, device)
                ids = batch["input_ids"]
                r, c = batch["loss_mask"][:, 1:].bool().nonzero(as_tuple=True)
                hidden = split.hidden(ids, position_ids=batch.get("position_ids"))[r, c]
                targets = ids[r, c + 1].unsqueeze(-1)
                step = chunk_rows(split.head.weight.shape[0])
                for s in range(0, max(1, hidden.shape[0]), step):
                    logits = (hidden[s:s + step] @ split.head.weight.t()).float()
                    t = targets[s:s + step]
                    margin = logits.gather(-1, t).squeeze(-1) - logits.scatter(-1, t, float("-inf")).amax(-1)
                    worst = min(worst, float(margin.min()))
                continue
            batch = collate(rows[i:i + batch_size], pad_id, device)
            logits = peft_model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1, :].float()
            targets = batch["input_ids"][:, 1:].unsqueeze(-1)
            mask = batch["loss_mask"][:, 1:].bool()
            chosen = logits.gather(-1, targets).squeeze(-1)
            others = logits.scatter(-1, targets, float("-inf")).amax(-1)
            worst = min(worst, float((chosen - others)[mask].min()))
    return worst


def epoch_batches(loop: TrainLoop, count: int, plan: Plan, per_epoch: int) -> Iterator[tuple[Any, tuple[int, int]]]:
    """The job's seeded batches of ``count`` items from the loop's cursor on, as (item indices, the
    cursor after that batch), for :meth:`TrainLoop.train` (which checks cancellation before drawing
    each); it ends once the loop is done (step cap reached)."""
    for epoch in range(loop.epoch, plan.epochs):
        order = epoch_order(count, seed=plan.seed, epoch=epoch)
        for b in range(loop.batch if epoch == loop.epoch else 0, per_epoch):
            if loop.done():
                return
            yield order[b * plan.batch_size:(b + 1) * plan.batch_size], (
                (epoch, b + 1) if b + 1 < per_epoch else (epoch + 1, 0))
