"""The two kinds trained on submitted data: SFT (examples) and pre-scored GRPO (groups with rewards).

``prepare_sft`` and ``prepare_grpo`` validate a request against the served model
(:class:`~kiln.training.plan.PrepareContext`), tokenize its data and return the job's plan;
:class:`~kiln.training.recipe.SFTRecipe` and :class:`~kiln.training.recipe.GRPORecipe` run it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kiln.training.data import (
    TrainingDataError,
    batches_per_epoch,
    default_epochs,
    load_sft_dataset,
    tokenize_grpo_group,
    tokenize_sft,
)
from kiln.training.plan import (
    GRPOData,
    JobPlan,
    LoraShape,
    PrepareContext,
    SFTData,
    anchor_fields,
    lora_fields,
    seal_plan,
)
from kiln.training.schemas import (
    DEFAULT_LEARNED_EVERY,
    DEFAULT_LEARNED_MAX_STEPS,
    DEFAULT_MAX_EPOCHS,
    DEFAULT_MIN_STEPS,
    MAX_EPOCHS,
    ROLLOUT_FIELDS,
    GRPORequest,
    SFTRequest,
)
from kiln.training.corrections import with_corrections
from kiln.training.trainer import GRPOSettings, LearnedCheck, Plan, grpo_items

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord


def _start(ctx: PrepareContext, request: SFTRequest | GRPORequest
           ) -> tuple[AdapterRecord | None, LoraShape, int, dict[str, Any]]:
    """The checks both kinds begin with: the adapter name, the base adapter and the LoRA shape; then the
    sequence limit and the effective request to complete."""
    ctx.check_adapter_name(request.adapter)
    parent = ctx.parent_of(request)
    lora = ctx.lora_shape(request, parent)
    limit = ctx.max_seq_len_limit
    max_len = request.max_seq_len if limit is None else min(request.max_seq_len, limit)
    return parent, lora, max_len, request.model_dump(mode="json") | anchor_fields(request)


def prepare_sft(ctx: PrepareContext, request: SFTRequest) -> JobPlan[SFTData]:
    """Inline ``examples`` or a JSONL ``dataset_path`` under the data dir, tokenized with the loss mask."""
    parent, lora, max_len, eff = _start(ctx, request)
    examples = request.examples
    limits = ctx.settings.training
    if request.dataset_path is not None:
        examples, eff["dataset_sha256"] = load_sft_dataset(ctx.settings.data_path, request.dataset_path,
                                                           max_examples=limits.max_examples)
    assert examples is not None
    if request.examples is not None:  # sequential corrections: the parent's, then these (kiln.training.corrections)
        examples, eff["corrections"], eff["replayed_corrections"] = with_corrections(
            parent, list(examples), replay=request.replay_corrections)
    if len(examples) > limits.max_examples:
        raise TrainingDataError(f"{len(examples)} examples exceed training.max_examples", code="too_many_examples")
    rows = tuple(tokenize_sft(ctx.model.tokenizer, examples, max_seq_len=max_len, end_ids=ctx.end_ids))
    until_learned = request.until_learned if request.until_learned is not None else request.epochs is None
    inputs = [e.model_dump(mode="json") for e in examples]
    return _plan("sft", ctx, request, eff, inputs, SFTData(rows), len(rows), lora, parent, max_len, until_learned)


def prepare_grpo(ctx: PrepareContext, request: GRPORequest) -> JobPlan[GRPOData]:
    """Pre-scored groups (single- or multi-turn completions): advantages computed now, zero-variance dropped."""
    parent, lora, max_len, eff = _start(ctx, request)
    tok = ctx.model.tokenizer
    assert request.groups is not None
    for key in ROLLOUT_FIELDS:  # a pre-scored job's plan is what it was before rollouts existed
        eff.pop(key, None)
    rewards = [[c.reward for c in g.completions] for g in request.groups]
    if any(c.turns for g in request.groups for c in g.completions):  # multi-turn episodes (OpenEnv)
        from kiln.training.grpo_rollouts import multi_turn_items

        items, skipped = multi_turn_items(tok, request.groups, rewards, max_seq_len=max_len,
                                          scale_rewards=request.scale_rewards)
    else:
        grouped = [tokenize_grpo_group(tok, g, max_seq_len=max_len) for g in request.groups]
        items, skipped = grpo_items(grouped, rewards, scale_rewards=request.scale_rewards)
    if not items:
        raise TrainingDataError(
            f"all {skipped} groups have identical rewards within each group; GRPO has nothing to learn",
            code="zero_variance_groups", hint="give each group completions with different rewards",
        )
    data = GRPOData(tuple(items), skipped, GRPOSettings(request.clip_epsilon, request.scale_rewards,
                                                       request.kl_coef, request.kl_estimator))
    inputs = [g.model_dump(mode="json") for g in request.groups]
    return _plan("grpo", ctx, request, eff, inputs, data, len(items), lora, parent, max_len, False)


def _plan(kind: str, ctx: PrepareContext, request: SFTRequest | GRPORequest, eff: dict[str, Any], inputs: Any,
          data: Any, n_items: int, lora: LoraShape, parent: AdapterRecord | None, max_len: int, until_learned: bool) -> JobPlan[Any]:
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
                max_steps=max_steps, until_learned=check)
    return JobPlan(kind, request.adapter, eff, inputs_sha, plan_sha, lora, loop, data, parent,
                   request.auto_load, request.resume_from_job)
