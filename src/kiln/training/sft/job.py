"""SFT: train on submitted examples (loss on assistant tokens), top to bottom: prepare, then train.

:func:`prepare_sft` validates a request against the served model
(:class:`~kiln.training.core.plan.PrepareContext`), tokenizes its examples and returns the job's plan
(:func:`supervised_start` and :func:`supervised_plan` are shared with pre-scored GRPO,
:mod:`kiln.training.grpo.job`); :func:`run_sft` trains it on :class:`~kiln.training.core.loop.TrainLoop`;
:class:`SFTRecipe` is the job's recipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from kiln.adapters.scope import SCOPE_CORRECTIONS, SCOPE_KEY, resolved_scope
from kiln.runtime.model_family import is_hybrid
from kiln.training.core.anchor import anchor_piece, anchor_term
from kiln.training.core.checkpoints import Checkpoint
from kiln.training.core.data import (
    Row,
    TrainingDataError,
    batches_per_epoch,
    collate,
    collate_packed,
    default_epochs,
    load_sft_dataset,
    tokenize_sft,
)
from kiln.training.core.loop import (
    Hooks,
    Learned,
    LearnedCheck,
    Piece,
    Plan,
    Report,
    StepInput,
    TrainLoop,
    epoch_batches,
    greedy_margin,
    token_mean_pieces,
)
from kiln.training.core.plan import (
    JobPlan,
    LoraShape,
    PrepareContext,
    anchor_fields,
    correction_target_modules,
    decay_fields,
    lora_fields,
    seal_plan,
)
from kiln.training.core.recipe import TrainingRecipe, step_plan
from kiln.training.core.step import TrunkRunner
from kiln.training.losses.chunked import sft_loss_from_hidden, split_causal_lm
from kiln.training.losses.sft import sft_loss
from kiln.training.schemas import (
    DEFAULT_ANCHOR_WEIGHT,
    DEFAULT_GRPO_ANCHOR_WEIGHT,
    DEFAULT_LEARNED_EVERY,
    DEFAULT_LEARNED_MAX_STEPS,
    DEFAULT_MAX_EPOCHS,
    DEFAULT_MIN_STEPS,
    DEFAULT_SFT_WEIGHT_DECAY,
    MAX_EPOCHS,
    GRPORequest,
    SFTRequest,
)
from kiln.training.sft.corrections import with_corrections

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord


@dataclass(frozen=True)
class SFTData:
    """An SFT job's plan data."""

    rows: tuple[Row, ...]  # tokenized examples, loss on assistant tokens


def supervised_start(ctx: PrepareContext, request: SFTRequest | GRPORequest
                     ) -> tuple[AdapterRecord | None, LoraShape, int, dict[str, Any]]:
    """The checks both kinds begin with: the adapter name, the base adapter and the LoRA shape; then the
    sequence limit and the effective request to complete."""
    ctx.check_adapter_name(request.adapter)
    parent = ctx.parent_of(request)
    sft = isinstance(request, SFTRequest)
    lora = ctx.lora_shape(request, parent, default_targets=correction_target_modules if sft else None)
    limit = ctx.max_seq_len_limit
    max_len = request.max_seq_len if limit is None else min(request.max_seq_len, limit)
    weight = DEFAULT_ANCHOR_WEIGHT if sft else DEFAULT_GRPO_ANCHOR_WEIGHT
    return parent, lora, max_len, request.model_dump(mode="json") | anchor_fields(request, default_weight=weight) \
        | decay_fields(request, default=DEFAULT_SFT_WEIGHT_DECAY if sft else 0.0)


def prepare_sft(ctx: PrepareContext, request: SFTRequest) -> JobPlan[SFTData]:
    """Inline ``examples`` or a JSONL ``dataset_path`` under the data dir, tokenized with the loss mask."""
    parent, lora, max_len, eff = supervised_start(ctx, request)
    eff[SCOPE_KEY] = resolved_scope(request.scope, parent.manifest.config if parent is not None else None,
                                    inline=request.examples is not None)
    if eff[SCOPE_KEY] == SCOPE_CORRECTIONS and request.examples is None:
        raise TrainingDataError("the base adapter is scoped to its corrections: give inline `examples` (or scope "
                                "\"off\")", param="scope")
    examples = request.examples
    limits = ctx.settings.training
    if request.dataset_path is not None:
        examples, eff["dataset_sha256"] = load_sft_dataset(ctx.settings.data_path, request.dataset_path,
                                                           max_examples=limits.max_examples)
    assert examples is not None
    if request.examples is not None:  # sequential corrections: the parent's, then these (kiln.training.sft.corrections)
        examples, eff["corrections"], eff["replayed_corrections"] = with_corrections(
            parent, list(examples), replay=request.replay_corrections)
    if len(examples) > limits.max_examples:
        raise TrainingDataError(f"{len(examples)} examples exceed training.max_examples", code="too_many_examples")
    tags = None
    if not request.reasoning_loss:  # the answers alone carry loss: the server's reasoning parser finds the spans
        from kiln.runtime.reasoning import reasoning_parser_for

        parser = reasoning_parser_for(ctx.settings.serving.reasoning_parser,
                                      getattr(ctx.model.tokenizer, "chat_template", None))
        tags = (parser.START, parser.END) if parser is not None else None
    rows = tuple(tokenize_sft(ctx.model.tokenizer, examples, max_seq_len=max_len, end_ids=ctx.end_ids,
                              reasoning_tags=tags))
    until_learned = request.until_learned if request.until_learned is not None else request.epochs is None
    inputs = [e.model_dump(mode="json") for e in examples]
    return supervised_plan("sft", ctx, request, eff, inputs, SFTData(rows), len(rows), lora, parent, max_len,
                           until_learned)


def supervised_plan(kind: str, ctx: PrepareContext, request: SFTRequest | GRPORequest, eff: dict[str, Any],
                    inputs: Any, data: Any, n_items: int, lora: LoraShape, parent: AdapterRecord | None, max_len: int,
                    until_learned: bool) -> JobPlan[Any]:
    """Resolve epochs and steps (``until_learned``: run until the examples are learned, capped), seal the
    digests, check a resumed job against them and build the loop plan."""
    max_steps = request.max_steps
    if until_learned and max_steps is None:
        max_steps = DEFAULT_LEARNED_MAX_STEPS
    if request.epochs is not None:
        epochs = request.epochs
    elif until_learned:
        epochs = min(MAX_EPOCHS, math.ceil(max_steps / batches_per_epoch(n_items, request.batch_size)))
    else:
        epochs = default_epochs(n_items, request.batch_size, min_steps=DEFAULT_MIN_STEPS,
                                max_epochs=DEFAULT_MAX_EPOCHS)
    eff.update(epochs=epochs, max_steps=max_steps, max_seq_len=max_len, **lora_fields(lora, parent))
    if kind == "sft":
        assert isinstance(request, SFTRequest)
        eff["until_learned"] = until_learned
        # the learned check runs once per pass over the examples (a one-example correction: every step, so it
        # stops at the first step that reproduces it), at most every DEFAULT_LEARNED_EVERY steps
        eff["learned_check_every"] = request.learned_check_every or min(
            DEFAULT_LEARNED_EVERY, batches_per_epoch(n_items, request.batch_size))
    inputs_sha, plan_sha = seal_plan(kind, eff, inputs, ctx.model.base_model_sha256)
    if request.resume_from_job is not None:
        ctx.check_resumable(request.resume_from_job, plan_sha, eff)
    check = None
    if until_learned:
        assert isinstance(request, SFTRequest)
        check = LearnedCheck(every=eff["learned_check_every"], margin=request.learned_margin)
    loop = Plan(request.learning_rate, epochs, request.batch_size, request.seed, request.checkpoint_interval,
                max_steps=max_steps, until_learned=check, weight_decay=eff["weight_decay"])
    return JobPlan(kind, request.adapter, eff, inputs_sha, plan_sha, lora, loop, data, parent,
                   request.auto_load, request.resume_from_job)

def run_sft(peft_model: Any, name: str, rows: Sequence[Row], plan: Plan, *, pad_id: int,
            hooks: Hooks | None = None, resume: Checkpoint | None = None, anchor: Any = None) -> Report:
    """Train adapter ``name`` on ``rows`` (loss on ``loss_mask`` tokens), plus the KL-to-base term of
    ``anchor`` (:class:`kiln.training.core.anchor.Anchor`) each step when given.

    With ``plan.until_learned`` the loop checks every ``every`` steps whether the
    targets are the greedy answer (by the margin) and stops as soon as they are;
    the report says why it stopped (``stopped``: learned, step_cap or epochs).
    """
    per_epoch = batches_per_epoch(len(rows), plan.batch_size)
    loop = TrainLoop(peft_model, name, plan, hooks or Hooks(), plan.epochs * per_epoch, resume)
    split = split_causal_lm(peft_model)  # logits only at the target positions, a chunk at a time
    # packed rows need the trunk's position_ids; a hybrid's recurrence would run across packed rows
    packing = plan.packing and split is not None and not is_hybrid(peft_model.config)
    runner = TrunkRunner(peft_model, split, gradient_checkpointing=plan.gradient_checkpointing, compile=plan.compile)
    if packing:  # kept across a resume, like every stat
        loop.stats.setdefault("packed_sequences", 0)
        loop.stats.setdefault("padded_positions_saved", 0)

    def steps() -> Iterator[StepInput]:
        for chosen, cursor in epoch_batches(loop, len(rows), plan, per_epoch):
            batch = (collate_packed if packing else collate)([rows[i] for i in chosen], pad_id, loop.device)
            if "rows_per_sequence" in batch:
                n, width = batch["input_ids"].shape
                loop.stats["packed_sequences"] += n
                loop.stats["padded_positions_saved"] += (len(chosen) - n) * width
            batch = runner.prepare(batch, pad_id)
            yield StepInput(batch, int(batch["attention_mask"].sum()), cursor)

    def rows_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if split is not None:
            hidden = runner.hidden(split, batch)
            return sft_loss_from_hidden(hidden, split.head.weight, batch["input_ids"], batch["loss_mask"])
        logits = peft_model(input_ids=batch["input_ids"], use_cache=False).logits
        return sft_loss(logits, batch["input_ids"], batch["loss_mask"])

    def loss_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = rows_loss(batch)
        if anchor is not None:
            loss = loss + anchor_term(anchor, peft_model, split, loop, pad_id)
        return loss

    def slicer(batch: dict[str, torch.Tensor], limit: int) -> list[Piece]:
        """Row micro-batches of the loss (each re-padded as the trunk needs it), the anchor rows as one more piece."""
        pieces = token_mean_pieces(batch, limit, lambda sb: rows_loss(runner.prepare(sb, pad_id)))
        if anchor is not None:
            pieces.append(anchor_piece(anchor, peft_model, split, loop, pad_id))
        return pieces

    def learned() -> bool:
        margin = loop.forward_holds(partial(greedy_margin, peft_model, rows, pad_id=pad_id, batch_size=plan.batch_size,
                                            packing=packing))
        return learned_by(loop, margin, plan)

    loop.train(steps(), loss_step, learned=sft_learned(plan, learned), around=runner.training, slicer=slicer)
    record_stop(loop, plan)
    return loop.report()


def sft_learned(plan: Plan, check: Callable[[], bool]) -> Learned | None:
    """SFT's learned check (``plan.until_learned``): every ``every`` steps, and once more at the end."""
    lc = plan.until_learned
    return None if lc is None else Learned(lc.every, check, final=True)


def learned_by(loop: TrainLoop, margin: float, plan: Plan) -> bool:
    """Record the greedy margin; the targets are learned when it reaches the check's margin."""
    loop.stats["greedy_margin"] = round(margin, 4)
    assert plan.until_learned is not None
    return margin >= plan.until_learned.margin


def record_stop(loop: TrainLoop, plan: Plan) -> None:
    """Why an SFT job stopped (its report's ``stopped``): learned, the step cap (with a learned check that
    never held) or the epochs."""
    if "learned_at_step" in loop.stats:
        loop.stats["stopped"] = "learned"
    elif plan.until_learned is not None and plan.max_steps is not None and loop.step >= plan.max_steps:
        loop.stats["stopped"] = "step_cap"
    else:
        loop.stats["stopped"] = "epochs"


class SFTRecipe(TrainingRecipe):
    """An SFT job: the loss on assistant tokens of the plan's tokenized examples."""

    plan: JobPlan[SFTData]

    def train(self, resume: Checkpoint | None) -> Report:
        rows = self.plan.data.rows
        report = run_sft(self.peft_model, self.private, rows, step_plan(self.plan, compile=self.ctx.compile),
                         pad_id=self.ctx.model.tokenizer.pad_token_id, hooks=self.ctx.hooks, resume=resume,
                         anchor=self.anchor([r.input_ids for r in rows]))
        self._phase("train")
        return report
