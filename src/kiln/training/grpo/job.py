"""Pre-scored GRPO: train on submitted groups of completions with rewards, top to bottom: prepare, then train.

:func:`prepare_grpo` checks a request like SFT does (:func:`kiln.training.sft.job.supervised_start`), tokenizes
its groups and computes their advantages (zero-variance groups dropped); :func:`run_grpo` trains on them with
the clipped GRPO step (:mod:`kiln.training.grpo.step`); :class:`GRPORecipe` is the job's recipe. GRPO that
samples and scores its own rollouts is :mod:`kiln.training.grpo.rollouts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from kiln.training.core.checkpoints import Checkpoint
from kiln.training.core.data import TrainingDataError, batches_per_epoch, tokenize_grpo_group
from kiln.training.core.errors import TrainingFailed
from kiln.training.core.loop import Hooks, Plan, Report, StepInput, TrainLoop, epoch_batches
from kiln.training.core.plan import JobPlan, PrepareContext
from kiln.training.core.recipe import TrainingRecipe, step_plan
from kiln.training.grpo.step import (
    GRPOItem,
    GRPOSettings,
    grpo_batch,
    grpo_items,
    grpo_loss,
    grpo_slicer,
    policy_logprobs,
    row_offsets,
)
from kiln.training.losses.chunked import split_causal_lm
from kiln.training.losses.grpo import GRPOLoss
from kiln.training.schemas import ROLLOUT_FIELDS, GRPORequest
from kiln.training.sft.job import supervised_plan, supervised_start


@dataclass(frozen=True)
class GRPOData:
    """A pre-scored GRPO job's plan data."""

    items: tuple[GRPOItem, ...]
    skipped: int  # zero-variance groups dropped at submission
    settings: GRPOSettings

def prepare_grpo(ctx: PrepareContext, request: GRPORequest) -> JobPlan[GRPOData]:
    """Pre-scored groups (single- or multi-turn completions): advantages computed now, zero-variance dropped."""
    parent, lora, max_len, eff = supervised_start(ctx, request)
    tok = ctx.model.tokenizer
    assert request.groups is not None
    for key in ROLLOUT_FIELDS:  # a pre-scored job's plan is what it was before rollouts existed
        eff.pop(key, None)
    rewards = [[c.reward for c in g.completions] for g in request.groups]
    if any(c.turns for g in request.groups for c in g.completions):  # multi-turn episodes (OpenEnv)
        from kiln.training.grpo.rollouts import multi_turn_items

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
    return supervised_plan("grpo", ctx, request, eff, inputs, data, len(items), lora, parent, max_len, False)


def run_grpo(peft_model: Any, name: str, items: Sequence[GRPOItem], plan: Plan, settings: GRPOSettings, *,
             pad_id: int, skipped_groups: int = 0, hooks: Hooks | None = None,
             resume: Checkpoint | None = None, anchor: Any = None) -> Report:
    """Group-relative policy optimisation over fixed, pre-scored completions.

    The ratio's denominator (``old_logp``) is the policy at the start of the job,
    computed once before the first step (and kept in checkpoints); the KL
    reference is the base model (all adapters disabled).
    """
    if not items:
        raise TrainingFailed(
            f"all {skipped_groups} groups have equal rewards within the group; nothing to learn from"
        )
    loss_fn = GRPOLoss(settings.clip_epsilon, settings.kl_coef, settings.kl_estimator)  # type: ignore[arg-type]
    per_epoch = batches_per_epoch(len(items), plan.batch_size)
    loop = TrainLoop(peft_model, name, plan, hooks or Hooks(), plan.epochs * per_epoch, resume)
    loop.stats.update({"groups": len(items) + skipped_groups, "skipped_zero_variance_groups": skipped_groups})
    split = split_causal_lm(peft_model)

    def steps() -> Iterator[StepInput]:
        # old_logp: one [len-1] tensor per row, from the policy before any update.
        if resume is not None:
            old = [resume.tensors[f"old.{i}"].to(loop.device) for i in range(sum(len(it.rows) for it in items))]
        else:
            old = policy_logprobs(peft_model, items, pad_id, loop, split)
        offsets = row_offsets(items)
        old_tensors = {f"old.{i}": t for i, t in enumerate(old)}
        for chosen, cursor in epoch_batches(loop, len(items), plan, per_epoch):
            b = grpo_batch(items, chosen, old, offsets, pad_id=pad_id, device=loop.device)
            yield StepInput(b, b.tokens, cursor, old_tensors)

    loop.train(steps(), lambda b: grpo_loss(peft_model, loop, loss_fn, settings, split, b, anchor=anchor,
                                            pad_id=pad_id),
               slicer=grpo_slicer(peft_model, loop, loss_fn, settings, split, anchor=anchor, pad_id=pad_id))
    return loop.report()


class GRPORecipe(TrainingRecipe):
    """A pre-scored GRPO job: clipped updates over the submitted groups' advantages."""

    plan: JobPlan[GRPOData]

    def train(self, resume: Checkpoint | None) -> Report:
        data = self.plan.data
        report = run_grpo(self.peft_model, self.private, data.items, step_plan(self.plan, compile=self.ctx.compile),
                          data.settings, pad_id=self.ctx.model.tokenizer.pad_token_id, skipped_groups=data.skipped,
                          hooks=self.ctx.hooks, resume=resume,
                          anchor=self.anchor([r.input_ids for it in data.items for r in it.rows]))
        self._phase("train")
        return report
