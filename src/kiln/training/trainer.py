"""The LoRA training loops (SFT and GRPO) on the served model.

The model being trained is the engine's own ``PeftModel``: the job adds a
private adapter to it, and every optimizer step runs inside ``exclusive()``
(the accelerator-ownership lock) with that adapter active, then hands the
model back to serving. Serving names its adapter per row, so the private
adapter is never applied to a request; the previously active adapter is put
back when the loop ends.

Batches are right-padded and the forward passes no attention mask: under causal
attention a real token never sees the padding after it, so its logits equal
those of the unpadded row (up to float rounding), and padded positions carry no
loss. Without a mask the attention kernel keeps its plain causal path.

Both loops read top to bottom: build the optimizer, restore a checkpoint if
given, then ``for epoch: for batch: forward -> loss -> backward -> step``.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from kiln.adapters.validate import CONFIG_FILE, WEIGHTS_FILE
from kiln.runtime.model_family import is_hybrid
from kiln.training.checkpoints import Checkpoint, save_checkpoint
from kiln.training.chunked_loss import SplitLM, chunk_rows, linear_token_logprobs, sft_loss_from_hidden, split_causal_lm
from kiln.training.data import Row, batches_per_epoch, collate, collate_packed, epoch_order
from kiln.training.losses import GRPOLoss, group_advantages, sft_loss, shifted_token_logprobs
from kiln.training.step import TrunkRunner

PROGRESS_EVERY_S = 0.25


class JobCancelled(Exception):
    """Raised at a step boundary when the job was asked to stop."""

    def __init__(self, step: int):
        super().__init__(f"cancelled at step {step}")
        self.step = step


class TrainingFailed(RuntimeError):
    """The loop cannot continue (non-finite loss, bad checkpoint...)."""


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


# ------------------------------------------------------------- private adapter


def lora_config(rank: int, alpha: float, target_modules: Sequence[str]) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM",
    )


def add_private_adapter(
    peft_model: Any, name: str, config: Any, *, seed: int, init_state: dict[str, torch.Tensor] | None = None
) -> list[torch.nn.Parameter]:
    """Add adapter ``name`` (seeded init, or ``init_state`` weights) and return its parameters.

    Call under exclusive ownership. The global RNG is left as it was.
    """
    from peft import set_peft_model_state_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model.add_adapter(name, config)
    if init_state is not None:
        result = set_peft_model_state_dict(peft_model, init_state, adapter_name=name)
        missing = [k for k in result.missing_keys if f".{name}." in k]
        if missing or result.unexpected_keys:
            raise TrainingFailed(
                f"the base adapter's weights do not match its LoRA config ({len(missing)} missing, "
                f"{len(result.unexpected_keys)} unexpected keys)"
            )
    return private_parameters(peft_model, name)


def private_parameters(peft_model: Any, name: str) -> list[torch.nn.Parameter]:
    params = [p for n, p in peft_model.named_parameters() if f".{name}." in n]
    if not params:
        raise TrainingFailed(f"adapter {name!r} has no parameters; do its target modules exist in the model?")
    return params


def adapter_state(peft_model: Any, name: str) -> dict[str, torch.Tensor]:
    """The adapter's weights keyed as in ``adapter_model.safetensors``."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, adapter_name=name)


def make_trainable(peft_model: Any, name: str, params: Sequence[torch.nn.Parameter]) -> None:
    """Make ``name`` the active adapter with trainable weights; a no-op when it already is.

    Called under exclusive ownership before every step, so an adapter change made
    between two steps (serving loads or deletes adapters) cannot make a step train
    the wrong weights. Serving always names its adapters per row, so leaving the
    private adapter active between steps changes nothing it computes.
    """
    if peft_model.active_adapter != name or not params[0].requires_grad:
        peft_model.base_model.set_adapter(name)


def release_private(peft_model: Any, name: str, previous: str) -> None:
    """Undo :func:`make_trainable`: reactivate ``previous`` and freeze the private weights."""
    if previous in peft_model.peft_config and previous != name:
        peft_model.base_model.set_adapter(previous, inference_mode=True)
    for p in private_parameters(peft_model, name):
        p.requires_grad_(False)


def save_adapter_files(peft_model: Any, name: str, out_dir: Path, *, base_model_dir: str) -> None:
    """Write standard PEFT files (``adapter_config.json`` + ``adapter_model.safetensors``) into ``out_dir``."""
    import json

    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous().clone() for k, v in adapter_state(peft_model, name).items()}
    for key, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise TrainingFailed(f"trained weight {key} is not finite; lower the learning rate")
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    cfg = peft_model.peft_config[name].to_dict()
    cfg["base_model_name_or_path"] = base_model_dir
    cfg["inference_mode"] = True
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))


# ------------------------------------------------------------------ shared loop


def _adamw(params: Sequence[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW, fused where this torch supports it for these parameters (one kernel for all
    adapter tensors: 1.7 -> 0.3 ms per step for the 64 LoRA tensors of the 31M bench shape)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


class _Loop:
    """Optimizer, counters, progress and checkpoints shared by both loops."""

    def __init__(self, peft_model: Any, name: str, plan: Plan, hooks: Hooks, total_steps: int,
                 resume: Checkpoint | None):
        self.peft_model, self.name, self.plan, self.hooks = peft_model, name, plan, hooks
        self.total_steps = total_steps if plan.max_steps is None else min(total_steps, plan.max_steps)
        self.params = private_parameters(peft_model, name)
        self.device = self.params[0].device
        self.previous = peft_model.active_adapter
        self.opt = _adamw(self.params, plan.learning_rate)
        self.step, self.epoch, self.batch = 0, 0, 0
        self.tokens, self.train_s, self.loss = 0, 0.0, float("nan")
        self.stats: dict[str, Any] = {}
        self._last_progress = 0.0
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
    def running(self) -> Iterator["_Loop"]:
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

    def optimizer_step(self, loss: torch.Tensor, tokens: int, started: float) -> None:
        if not torch.isfinite(loss):
            raise TrainingFailed(f"loss became {loss.item()} at step {self.step + 1}; lower the learning rate")
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = float(loss.detach())
        self.step += 1
        self.tokens += tokens
        self.train_s += time.perf_counter() - started

    def after_step(self, next_epoch: int, next_batch: int, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.epoch, self.batch = next_epoch, next_batch
        p = self.plan
        if (p.checkpoint_interval and self.hooks.checkpoint_root is not None
                and self.step % p.checkpoint_interval == 0 and self.step < self.total_steps):
            save_checkpoint(
                self.hooks.checkpoint_root, step=self.step, epoch=next_epoch, batch=next_batch,
                plan_sha256=self.hooks.plan_sha256, adapter_state=adapter_state(self.peft_model, self.name),
                optimizer_state=self.opt.state_dict(), tensors=tensors,
                stats={"tokens": self.tokens, "train_s": self.train_s, "loss": self.loss, "extra": self.stats,
                       "step_options": self.plan.step_options()},
            )
            self.checkpoint_step = self.step
        now = time.perf_counter()
        if now - self._last_progress >= PROGRESS_EVERY_S or self.step == self.total_steps:
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
            "eta_s": round(per_step * (self.total_steps - self.step), 2) if per_step is not None else None,
            "checkpoint_step": self.checkpoint_step,
            **self.stats,
        }

    def report(self) -> Report:
        return Report(self.step, self.total_steps, self.loss, self.tokens, self.train_s, dict(self.stats))


# -------------------------------------------------------------------------- SFT


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


def epoch_batches(loop: _Loop, count: int, plan: Plan, per_epoch: int) -> Iterator[tuple[Any, tuple[int, int]]]:
    """The job's seeded batches of ``count`` items from the loop's cursor on, as (item indices, the
    cursor after that batch); cancellation is checked before each batch, and it ends once the loop
    is done (step cap reached)."""
    for epoch in range(loop.epoch, plan.epochs):
        order = epoch_order(count, seed=plan.seed, epoch=epoch)
        for b in range(loop.batch if epoch == loop.epoch else 0, per_epoch):
            if loop.done():
                return
            loop.check_cancel()
            yield order[b * plan.batch_size:(b + 1) * plan.batch_size], (
                (epoch, b + 1) if b + 1 < per_epoch else (epoch + 1, 0))


def drive_sft_epochs(loop: _Loop, rows: Sequence[Row], plan: Plan, per_epoch: int,
                     train_batch: Callable[[list[Row]], None], learned: Callable[[], bool], *,
                     before_cursor: Callable[[int, int], None] | None = None) -> None:
    """The SFT epoch loop, shared by one process (:func:`run_sft`) and torchrun
    (:mod:`kiln.training.distributed`): seeded batch order, cancel, the learned check every
    ``until_learned.every`` steps, the checkpoint cursor; records ``stopped``/``learned`` in the stats."""
    check = plan.until_learned
    stopped = "epochs"
    for chosen, cursor in epoch_batches(loop, len(rows), plan, per_epoch):
        train_batch([rows[i] for i in chosen])
        if check is not None and loop.step % check.every == 0 and learned():
            stopped = "learned"
            loop.stats["learned_at_step"] = loop.step
            loop.total_steps = loop.step
        if before_cursor is not None:
            before_cursor(*cursor)
        loop.after_step(*cursor)
        if stopped == "learned":
            break
    if check is not None and stopped != "learned":
        if learned():
            stopped, loop.stats["learned_at_step"] = "learned", loop.step
        else:
            stopped = "step_cap" if plan.max_steps is not None and loop.step >= plan.max_steps else "epochs"
    if check is not None:
        loop.stats["learned"] = stopped == "learned"
    loop.stats["stopped"] = stopped


def run_sft(peft_model: Any, name: str, rows: Sequence[Row], plan: Plan, *, pad_id: int,
            hooks: Hooks | None = None, resume: Checkpoint | None = None, anchor: Any = None) -> Report:
    """Train adapter ``name`` on ``rows`` (loss on ``loss_mask`` tokens), plus the KL-to-base term of
    ``anchor`` (:class:`kiln.training.anchor.Anchor`) each step when given.

    With ``plan.until_learned`` the loop checks every ``every`` steps whether the
    targets are the greedy answer (by the margin) and stops as soon as they are;
    the report says why it stopped (``stopped``: learned, step_cap or epochs).
    """
    hooks = hooks or Hooks()
    per_epoch = batches_per_epoch(len(rows), plan.batch_size)
    loop = _Loop(peft_model, name, plan, hooks, plan.epochs * per_epoch, resume)
    check = plan.until_learned
    split = split_causal_lm(peft_model)  # logits only at the target positions, a chunk at a time
    # packed rows need the trunk's position_ids; a hybrid's recurrence would run across packed rows
    packing = plan.packing and split is not None and not is_hybrid(peft_model.config)
    runner = TrunkRunner(peft_model, split, gradient_checkpointing=plan.gradient_checkpointing, compile=plan.compile)
    if packing:  # kept across a resume, like every stat
        loop.stats.setdefault("packed_sequences", 0)
        loop.stats.setdefault("padded_positions_saved", 0)

    def learned() -> bool:
        with loop.step_ownership():
            margin = greedy_margin(peft_model, rows, pad_id=pad_id, batch_size=plan.batch_size, packing=packing)
        loop.stats["greedy_margin"] = round(margin, 4)
        return margin >= check.margin  # type: ignore[union-attr]

    def train_batch(chosen: list[Row]) -> None:
        batch = (collate_packed if packing else collate)(chosen, pad_id, loop.device)
        if "rows_per_sequence" in batch:
            n, width = batch["input_ids"].shape
            loop.stats["packed_sequences"] += n
            loop.stats["padded_positions_saved"] += (len(chosen) - n) * width
        batch = runner.prepare(batch, pad_id)
        with loop.step_ownership(), runner.training():
            t0 = time.perf_counter()
            if split is not None:
                hidden = runner.hidden(split, batch)
                loss = sft_loss_from_hidden(hidden, split.head.weight, batch["input_ids"], batch["loss_mask"])
            else:
                logits = peft_model(input_ids=batch["input_ids"], use_cache=False).logits
                loss = sft_loss(logits, batch["input_ids"], batch["loss_mask"])
            if anchor is not None:
                loss = loss + anchor_term(anchor, peft_model, split, loop, pad_id)
            loop.optimizer_step(loss, int(batch["attention_mask"].sum()), t0)

    with loop.running():
        drive_sft_epochs(loop, rows, plan, per_epoch, train_batch, learned)
    return loop.report()


def anchor_term(anchor: Any, peft_model: Any, split: SplitLM | None, loop: _Loop, pad_id: int) -> torch.Tensor:
    """The step's KL-to-base anchor loss (zero without rows); its value is kept in the stats as ``anchor_kl``."""
    term = anchor.loss(peft_model, split, loop.step, pad_id, loop.device)
    if term is None:
        return torch.zeros((), device=loop.device)
    loop.stats["anchor_kl"] = round(float(term.detach()) / max(anchor.settings.weight, 1e-12), 6)
    loop.stats["anchor_rows"] = len(anchor)
    return term


# ------------------------------------------------------------------------- GRPO


@dataclass(frozen=True)
class GRPOItem:
    """One usable group: its rows and one advantage per row."""

    rows: list[Row]
    advantages: torch.Tensor  # [G]


@dataclass(frozen=True)
class GRPOSettings:
    clip_epsilon: float = 0.2
    scale_rewards: bool = True
    kl_coef: float = 0.0
    kl_estimator: str = "k3"


def grpo_items(groups_rows: Sequence[list[Row]], rewards: Sequence[Sequence[float]], *,
               scale_rewards: bool) -> tuple[list[GRPOItem], int]:
    """Compute advantages; drop zero-variance groups. Returns ``(items, skipped)``."""
    items, skipped = [], 0
    for rows, r in zip(groups_rows, rewards):
        adv = group_advantages(torch.tensor(list(r), dtype=torch.float64), scale_by_std=scale_rewards)
        if adv is None:
            skipped += 1
        else:
            items.append(GRPOItem(list(rows), adv))
    return items, skipped


def _sequence_logprobs(peft_model: Any, batch: dict[str, torch.Tensor], split: SplitLM | None = None,
                       mask: torch.Tensor | None = None, fill: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T-1]`` log-probabilities of each next token (right padding, no mask: see the module docstring).

    With ``split`` the head runs a chunk at a time; with ``mask`` (``[B, T-1]``) too, only
    at the masked positions, the others taken from ``fill`` (``[B, T-1]``, detached).
    """
    ids = batch["input_ids"]
    if split is None:
        return shifted_token_logprobs(peft_model(input_ids=ids, use_cache=False).logits, ids)
    hidden = split.hidden(ids)
    if mask is None:
        b, t = ids.shape
        flat = linear_token_logprobs(hidden[:, :-1].reshape(b * (t - 1), -1), split.head.weight,
                                     ids[:, 1:].reshape(-1))
        return flat.view(b, t - 1)
    assert fill is not None
    rows, cols = mask.bool().nonzero(as_tuple=True)
    chosen = linear_token_logprobs(hidden[rows, cols], split.head.weight, ids[rows, cols + 1])
    return fill.detach().index_put((rows, cols), chosen)


def _padded(rows_logp: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros((len(rows_logp), width), dtype=torch.float32, device=device)
    for i, v in enumerate(rows_logp):
        out[i, : v.numel()] = v
    return out


def policy_logprobs(peft_model: Any, items: Sequence[GRPOItem], pad_id: int, loop: _Loop,
                    split: SplitLM | None) -> list[torch.Tensor]:
    """Per row of every item, the current policy's token log-probs (``[len - 1]``), without gradients:
    the ratio's denominator for the GRPO updates that follow."""
    old: list[torch.Tensor] = []
    with torch.no_grad(), loop.step_ownership():
        for item in items:
            lp = _sequence_logprobs(peft_model, collate(item.rows, pad_id, loop.device), split)
            old.extend(lp[j, : len(r.input_ids) - 1].clone() for j, r in enumerate(item.rows))
    return old


def row_offsets(items: Sequence[GRPOItem]) -> list[int]:
    """``offsets[g]`` is the index of item ``g``'s first row in the flat per-row list; the last entry is the total."""
    offsets = [0]
    for item in items:
        offsets.append(offsets[-1] + len(item.rows))
    return offsets


def grpo_step(peft_model: Any, loop: _Loop, loss_fn: GRPOLoss, settings: GRPOSettings, split: SplitLM | None,
              items: Sequence[GRPOItem], chosen: Sequence[int], old: Sequence[torch.Tensor], offsets: Sequence[int],
              *, pad_id: int, anchor: Any = None) -> None:
    """One clipped GRPO optimizer step on the rows of ``items[g]`` for ``g`` in ``chosen``, under exclusive
    ownership. ``old`` holds the behaviour policy's log-probs per row (:func:`policy_logprobs`), indexed by
    ``offsets`` (:func:`row_offsets`). Shared by :func:`run_grpo` and :mod:`kiln.training.grpo_rollouts`."""
    rows = [r for g in chosen for r in items[g].rows]
    adv = torch.cat([items[g].advantages for g in chosen]).to(loop.device)
    old_lp = [old[offsets[g] + j] for g in chosen for j in range(len(items[g].rows))]
    batch = collate(rows, pad_id, loop.device)
    mask = batch["loss_mask"][:, 1:]
    with loop.step_ownership():
        t0 = time.perf_counter()
        ref = None
        old_padded = _padded(list(old_lp), mask.shape[1], loop.device)
        if settings.kl_coef > 0:
            with torch.no_grad(), peft_model.disable_adapter():
                ref = _sequence_logprobs(peft_model, batch, split, mask, old_padded)
        logp = _sequence_logprobs(peft_model, batch, split, mask, old_padded)
        loss, st = loss_fn(logp, old_padded, adv, mask, ref)
        if anchor is not None:  # the KL-to-base anchor (kiln.training.anchor)
            loss = loss + anchor_term(anchor, peft_model, split, loop, pad_id)
        loop.optimizer_step(loss, int(batch["attention_mask"].sum()), t0)
    loop.stats.update({"clip_fraction": round(st["clip_fraction"], 4), "kl": round(st["kl"], 6)})


def run_grpo(peft_model: Any, name: str, items: Sequence[GRPOItem], plan: Plan, settings: GRPOSettings, *,
             pad_id: int, skipped_groups: int = 0, hooks: Hooks | None = None,
             resume: Checkpoint | None = None, anchor: Any = None) -> Report:
    """Group-relative policy optimisation over fixed, pre-scored completions.

    The ratio's denominator (``old_logp``) is the policy at the start of the job,
    computed once before the first step (and kept in checkpoints); the KL
    reference is the base model (all adapters disabled).
    """
    hooks = hooks or Hooks()
    if not items:
        raise TrainingFailed(
            f"all {skipped_groups} groups have equal rewards within the group; nothing to learn from"
        )
    loss_fn = GRPOLoss(settings.clip_epsilon, settings.kl_coef, settings.kl_estimator)  # type: ignore[arg-type]
    per_epoch = batches_per_epoch(len(items), plan.batch_size)
    loop = _Loop(peft_model, name, plan, hooks, plan.epochs * per_epoch, resume)
    loop.stats.update({"groups": len(items) + skipped_groups, "skipped_zero_variance_groups": skipped_groups})
    split = split_causal_lm(peft_model)

    with loop.running():
        # old_logp: one [len-1] tensor per row, from the policy before any update.
        if resume is not None:
            old = [resume.tensors[f"old.{i}"].to(loop.device) for i in range(sum(len(it.rows) for it in items))]
        else:
            old = policy_logprobs(peft_model, items, pad_id, loop, split)
        offsets = row_offsets(items)
        old_tensors = {f"old.{i}": t for i, t in enumerate(old)}

        for chosen, cursor in epoch_batches(loop, len(items), plan, per_epoch):
            grpo_step(peft_model, loop, loss_fn, settings, split, items, chosen, old, offsets, pad_id=pad_id,
                      anchor=anchor)
            loop.after_step(*cursor, tensors=old_tensors)
    return loop.report()
