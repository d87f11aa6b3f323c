"""GRPO that samples and scores its own rollouts: ``POST /v1/train/grpo`` with ``prompts`` and a ``reward``.

Each of ``iterations`` rounds: sample ``group_size`` completions per prompt with the policy being
trained -> score them (:mod:`kiln.training.grpo.rewards`) -> group-normalised advantages (zero-variance
groups dropped, counted) -> ``epochs`` passes of clipped GRPO updates over that round's groups, with
the round's sampling policy as the ratio's denominator (on-policy: ratio 1 at the round's first step).

Behaviour policy. The first round samples from the job's starting point: ``base_adapter`` at its
published revision (recorded in the result), or the base model (a fresh LoRA adapter is zero at init).
Later rounds sample from the private adapter as updated so far. Sampling is OPD's:
:func:`kiln.training.core.engine_sampling.sample_policy` runs the rows on the serving engine's continuous
batching with the private adapter by PEFT key (prefix cache keyed ``key#step-N``, N the optimizer steps
taken, so blocks computed with older weights are never reused; one seed per row), interleaved with
serving. The behaviour log-probs (the ratio's denominator) come from the trainer's own forward pass
(:func:`kiln.training.grpo.step.policy_logprobs`), not from the sampler.

Checkpoints (``checkpoint_interval``) and ``resume_from_job`` work as for pre-scored jobs: a checkpoint
written inside an iteration stores that iteration's groups and behaviour log-probs with it, and
sampling is seeded per iteration, so a resumed job ends with the uninterrupted job's weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from kiln.errors import InvalidRequest
from kiln.runtime.chat_generation import ChatGeneration
from kiln.training.core.data import Row, epoch_order
from kiln.training.core.engine_sampling import check_samples_fit_queue, sample_policy, sampler_name
from kiln.training.core.errors import TrainingFailed
from kiln.training.core.loop import Plan
from kiln.training.core.plan import JobPlan, PrepareContext, anchor_fields, decay_fields, lora_fields, seal_plan
from kiln.training.core.recipe import TrainingRecipe
from kiln.training.core.templates import end_of_turn_ids
from kiln.training.grpo.rewards import RewardError, RewardFn, build_reward
from kiln.training.grpo.step import GRPOItem, GRPOSettings, grpo_items
from kiln.training.schemas import (
    DEFAULT_GRPO_ROLLOUT_ANCHOR_WEIGHT,
    DEFAULT_GRPO_ROLLOUT_ITERATIONS,
    DEFAULT_GRPO_ROLLOUT_LEARNING_RATE,
    GRPORequest,
)

DEFAULT_GROUP_SIZE = 8
DEFAULT_ITERATIONS = DEFAULT_GRPO_ROLLOUT_ITERATIONS
DEFAULT_MAX_TOKENS = 64
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class RolloutData:
    prompt_ids: tuple[tuple[int, ...], ...]
    reward: RewardFn
    group_size: int
    iterations: int
    max_tokens: int
    temperature: float
    top_p: float
    settings: GRPOSettings
    behaviour: dict[str, Any]  # the starting policy (adapter, revision) and how it is sampled
    gen: ChatGeneration | None = None  # how prompts are rendered and answers read (None: as the base template)
    reasoning_loss: bool = True  # whether the reasoning span's tokens carry the advantage's loss


def prepare_rollouts(ctx: PrepareContext, request: GRPORequest) -> JobPlan[RolloutData]:
    """Validate a GRPO request with ``prompts`` (reward, lengths, data dir, loopback) and return its plan."""
    assert request.prompts is not None and request.reward is not None
    ctx.check_adapter_name(request.adapter)
    settings = ctx.settings
    engine = ctx.serving_engine("GRPO rollout")
    reward = build_reward(request.reward, request.prompts, data_dir=settings.data_path,
                          allow_code_execution=settings.eval.allow_code_execution, engine=engine,
                          judge_contract=ChatGeneration.for_engine(engine, settings.serving))
    parent = ctx.parent_of(request)
    lora = ctx.lora_shape(request, parent)
    group_size = request.group_size or DEFAULT_GROUP_SIZE
    iterations = request.iterations or DEFAULT_ITERATIONS
    max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
    temperature = request.temperature if request.temperature is not None else DEFAULT_TEMPERATURE
    top_p = request.top_p if request.top_p is not None else DEFAULT_TOP_P
    check_samples_fit_queue(engine, group_size, "group_size")
    limit = min(request.max_seq_len, engine.config.max_model_len)
    if ctx.max_seq_len_limit is not None:
        limit = min(limit, ctx.max_seq_len_limit)
    gen = ChatGeneration.for_engine(engine, settings.serving, request.chat_template_kwargs, request.budget())
    prompt_ids = []
    for i, p in enumerate(request.prompts):
        ids = gen.prompt_ids([m.model_dump() for m in p.messages])
        if len(ids) + max_tokens > limit:
            raise InvalidRequest(f"prompt {i} ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                 f"limit of {limit}", code="sequence_too_long", param="prompts",
                                 hint="shorten the prompt or lower max_tokens")
        prompt_ids.append(tuple(ids))
    epochs = request.epochs or 1
    if "learning_rate" not in request.model_fields_set:  # the rollout default (schemas: why it differs)
        request = request.model_copy(update={"learning_rate": DEFAULT_GRPO_ROLLOUT_LEARNING_RATE})
    eff = request.model_dump(mode="json")
    eff.pop("groups", None)
    eff.update(group_size=group_size, iterations=iterations, max_tokens=max_tokens, temperature=temperature,
               top_p=top_p, epochs=epochs, max_seq_len=limit, reward_source=reward.describe,
               **lora_fields(lora, parent), **anchor_fields(request, default_weight=DEFAULT_GRPO_ROLLOUT_ANCHOR_WEIGHT),
               **decay_fields(request))
    inputs = [p.model_dump(mode="json") for p in request.prompts]
    inputs_sha, plan_sha = seal_plan("grpo", eff, inputs, ctx.model.base_model_sha256)
    if request.resume_from_job is not None:
        ctx.check_resumable(request.resume_from_job, plan_sha)
    behaviour = {"adapter": None if parent is None else parent.name,
                 "revision": None if parent is None else parent.revision, "sampler": sampler_name(engine)}
    data = RolloutData(tuple(prompt_ids), reward, group_size, iterations, max_tokens, temperature, top_p,
                       GRPOSettings(request.clip_epsilon, request.scale_rewards, request.kl_coef,
                                    request.kl_estimator), behaviour, gen, request.reasoning_loss)
    loop = Plan(request.learning_rate, epochs, request.batch_size, request.seed, request.checkpoint_interval,
                max_steps=request.max_steps, weight_decay=eff["weight_decay"])
    return JobPlan("grpo", request.adapter, eff, inputs_sha, plan_sha, lora, loop, data,
                   parent, request.auto_load, request.resume_from_job)


def run_rollouts(peft_model: Any, name: str, data: RolloutData, plan: Any, *, decode: Any, hooks: Any,
                 pad_id: int, end_ids: Sequence[int], resume: Any = None, engine: Any = None,
                 anchor: Any = None) -> Any:
    """The loop described in the module docstring; returns the trainer's Report (stats per iteration).

    Checkpoints (``checkpoint_interval`` steps) carry the adapter, the optimizer and the position
    ``(epoch, batch)`` where ``epoch`` counts ``iteration * epochs + pass``; a checkpoint inside an
    iteration also carries that iteration's groups (token IDs, masks, advantages) and behaviour
    log-probs, so a resumed job continues the same updates instead of sampling again. Sampling is
    seeded per iteration, so later iterations sample what the uninterrupted job sampled.
    """
    from kiln.training.core.loop import StepInput, TrainLoop
    from kiln.training.grpo.step import grpo_loss, grpo_slicer, policy_logprobs
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.losses.grpo import GRPOLoss

    s = data.settings
    loss_fn = GRPOLoss(s.clip_epsilon, s.kl_coef, s.kl_estimator)  # type: ignore[arg-type]
    n = len(data.prompt_ids)
    per_round = plan.epochs * math.ceil(n / plan.batch_size)
    loop = TrainLoop(peft_model, name, plan, hooks, data.iterations * per_round, resume)
    split = split_causal_lm(peft_model)  # the trainer's chunked head: logits at completion tokens only
    rewards_hist: list[float] = list(loop.stats.get("reward_per_iteration", []))  # restored on resume
    zero_hist: list[float] = list(loop.stats.get("zero_variance_fraction_per_iteration", []))
    loop.stats.update({"iterations": data.iterations, "iteration": loop.stats.get("iteration", 0),
                       "behaviour_policy": data.behaviour, "reward_per_iteration": rewards_hist,
                       "zero_variance_fraction_per_iteration": zero_hist,
                       "sample_s": loop.stats.get("sample_s", 0.0), "reward_s": loop.stats.get("reward_s", 0.0),
                       "generation": None if data.gen is None else data.gen.describe(data.prompt_ids)})
    first_it, first_pass = divmod(loop.epoch, plan.epochs)
    saved = _saved_iteration(resume) if resume is not None and (first_pass or loop.batch) else None

    def steps() -> Iterator[StepInput]:
        nonlocal saved, first_pass
        for it in range(first_it, data.iterations):
            if loop.done():
                return
            loop.check_cancel()
            if saved is not None:  # resumed inside this iteration: its groups and behaviour log-probs
                (items, old), saved = saved, None
            else:
                items = _sample_and_score(peft_model, data, plan, loop, it, rewards_hist, zero_hist, decode=decode,
                                          pad_id=pad_id, end_ids=end_ids, engine=engine)
                first_pass = 0
                old = policy_logprobs(peft_model, items, pad_id, loop, split) if items else []
            if items:  # 3. update: epochs passes over the round's groups; the sampling policy is the denominator
                yield from _update_steps(loop, plan, it, first_pass, items, old, pad_id=pad_id)
            loop.epoch, loop.batch, first_pass = (it + 1) * plan.epochs, 0, 0
            hooks.on_progress(loop.progress())  # every round's reward shows in status at once

    loop.train(steps(), lambda b: grpo_loss(peft_model, loop, loss_fn, s, split, b, anchor=anchor, pad_id=pad_id),
               slicer=grpo_slicer(peft_model, loop, loss_fn, s, split, anchor=anchor, pad_id=pad_id))
    loop.total_steps = loop.step
    hooks.on_progress(loop.progress())
    if loop.step == 0:
        raise TrainingFailed(f"every group of all {len(rewards_hist)} iteration(s) had identical rewards (mean "
                             f"rewards {rewards_hist}); nothing to learn from: sample more (group_size, "
                             "temperature) or use a reward that separates completions")
    return loop.report()


def _update_steps(loop: Any, plan: Any, it: int, first_pass: int, items: Sequence[Any], old: Sequence[Any], *,
                  pad_id: int) -> Iterator[Any]:
    """Iteration ``it``'s GRPO steps: ``plan.epochs`` seeded passes over its groups (from the resumed cursor),
    each step's cursor counting ``iteration * epochs + pass``; checkpoints carry the iteration's groups."""
    from kiln.training.core.loop import StepInput
    from kiln.training.grpo.step import grpo_batch, row_offsets

    offsets = row_offsets(items)
    batches = math.ceil(len(items) / plan.batch_size)
    tensors = _iteration_tensors(items, old) if plan.checkpoint_interval else None
    for epoch in range(first_pass, plan.epochs):
        ge = it * plan.epochs + epoch
        order = epoch_order(len(items), seed=plan.seed, epoch=ge)
        for b in range(loop.batch if (epoch == first_pass and loop.epoch == ge) else 0, batches):
            chosen = order[b * plan.batch_size:(b + 1) * plan.batch_size]
            gb = grpo_batch(items, chosen, old, offsets, pad_id=pad_id, device=loop.device)
            yield StepInput(gb, gb.tokens, (ge, b + 1) if b + 1 < batches else (ge + 1, 0), tensors)


def _sample_and_score(peft_model: Any, data: RolloutData, plan: Any, loop: Any, it: int, rewards_hist: list[float],
                      zero_hist: list[float], *, decode: Any, pad_id: int, end_ids: Sequence[int],
                      engine: Any) -> list[GRPOItem]:
    """One iteration's groups: sample (the current policy, seeded by iteration), score, advantages."""
    n = len(data.prompt_ids)
    t0 = time.perf_counter()
    gen = data.gen
    comps = sample_policy(peft_model, loop, engine, [list(p) for p in data.prompt_ids], data.group_size,
                          data.max_tokens, data.temperature, data.top_p, seed=plan.seed, seed_step=it,
                          revision=f"step-{loop.step}", pad_id=pad_id, end_ids=end_ids,
                          constrain=None if gen is None else lambda k, params: gen.constrain(params, data.prompt_ids[k]))
    t1 = time.perf_counter()
    # score outside exclusive ownership: serving goes on meanwhile; rewards read the answer, not the reasoning
    owners = [data.prompt_ids[k // data.group_size] for k in range(len(comps))]
    answers = [gen.split(decode(c), p) if gen is not None else None for c, p in zip(comps, owners)]
    texts = [a.content if a is not None else decode(c) for a, c in zip(answers, comps)]
    try:
        flat = data.reward([(k // data.group_size, t) for k, t in enumerate(texts)],
                           [a.reasoning if a is not None else None for a in answers])
    except RewardError as exc:
        raise TrainingFailed(f"iteration {it + 1}: {exc}") from None
    t2 = time.perf_counter()
    grouped_rows, grouped_rewards = [], []
    for i, prompt in enumerate(data.prompt_ids):
        sl = slice(i * data.group_size, (i + 1) * data.group_size)
        grouped_rows.append([Row(list(prompt) + c, [0] * len(prompt) + (
            gen.answer_mask(prompt, c) if gen is not None and not data.reasoning_loss else [1] * len(c)))
            for c in comps[sl]])
        grouped_rewards.append(flat[sl])
    if not any(1 in row.loss_mask for rows in grouped_rows for row in rows):
        raise TrainingFailed(f"iteration {it + 1}: with reasoning_loss false no sample has an answer after its "
                             "reasoning span to train on (every span was cut): raise max_tokens or set a "
                             "thinking_token_budget")
    items, skipped = grpo_items(grouped_rows, grouped_rewards, scale_rewards=data.settings.scale_rewards)
    rewards_hist.append(round(sum(flat) / len(flat), 6))
    zero_hist.append(round(skipped / n, 6))
    loop.stats.update({"iteration": it + 1, "mean_reward": rewards_hist[-1], "zero_variance_fraction": zero_hist[-1],
                       "sample_s": round(loop.stats["sample_s"] + t1 - t0, 4),
                       "reward_s": round(loop.stats["reward_s"] + t2 - t1, 4)})
    return items


def _iteration_tensors(items: Sequence[GRPOItem], old: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """An iteration's groups and behaviour log-probs as checkpoint tensors (see :func:`_saved_iteration`)."""
    out: dict[str, torch.Tensor] = {"it.group_rows": torch.tensor([len(x.rows) for x in items], dtype=torch.long)}
    k = 0
    for g, item in enumerate(items):
        out[f"it.adv.{g}"] = item.advantages
        for row in item.rows:
            out[f"it.ids.{k}"] = torch.tensor(row.input_ids, dtype=torch.long)
            out[f"it.mask.{k}"] = torch.tensor(row.loss_mask, dtype=torch.long)
            out[f"it.old.{k}"] = old[k]
            k += 1
    return out


def _saved_iteration(ckpt: Any) -> tuple[list[GRPOItem], list[torch.Tensor]]:
    t = ckpt.tensors
    if "it.group_rows" not in t:
        raise TrainingFailed(f"checkpoint {ckpt.path.name} has no saved iteration to resume inside of")
    items, old, k = [], [], 0
    for g, count in enumerate(t["it.group_rows"].tolist()):
        rows = []
        for _ in range(count):
            rows.append(Row(t[f"it.ids.{k}"].tolist(), t[f"it.mask.{k}"].tolist()))
            old.append(t[f"it.old.{k}"])
            k += 1
        items.append(GRPOItem(rows, t[f"it.adv.{g}"]))
    return items, old


def multi_turn_items(tokenizer: Any, groups: Sequence[Any], rewards: Sequence[Sequence[float]], *,
                     max_seq_len: int, scale_rewards: bool) -> tuple[list[Any], int]:
    """GRPO items for pre-scored groups whose completions are multi-turn episodes (``Completion.turns``).

    Every action of an episode becomes one row: its prompt is the conversation before it (the
    group's messages, then each earlier action as an assistant turn and each observation as a user
    turn, under the chat template with the generation prompt), exactly what the policy was given
    when it acted. Advantages are normalised over the group's episode returns and every row of an
    episode carries its episode's advantage, so each action token gets it. A completion without
    ``turns`` is one row, as in :func:`~kiln.training.core.data.tokenize_grpo_group`.
    """
    from kiln.training.core.data import grpo_prompt_ids, grpo_row

    per_group = []
    for group in groups:
        conversation = [m.model_dump() for m in group.messages]
        first = grpo_prompt_ids(tokenizer, conversation)
        episodes = []
        for c in group.completions:
            rows = [grpo_row(tokenizer, first, c.text, max_seq_len=max_seq_len)]
            history, last = list(conversation), c.text
            for turn in c.turns or ():
                history += [{"role": "assistant", "content": last}, {"role": "user", "content": turn.observation}]
                rows.append(grpo_row(tokenizer, grpo_prompt_ids(tokenizer, history), turn.text,
                                     max_seq_len=max_seq_len))
                last = turn.text
            episodes.append(rows)
        per_group.append(episodes)
    items, skipped = grpo_items(per_group, rewards, scale_rewards=scale_rewards)  # one advantage per episode
    return [GRPOItem([row for rows in it.rows for row in rows],
                     it.advantages.repeat_interleave(torch.tensor([len(rows) for rows in it.rows])))
            for it in items], skipped


class RolloutRecipe(TrainingRecipe):
    """A rollout GRPO job: setup -> (sample -> score -> update) x iterations -> save -> publish -> activate."""

    plan: JobPlan[RolloutData]

    def train(self, resume: Any) -> Any:
        tok = self.ctx.model.tokenizer
        end_ids = sorted(end_of_turn_ids(tok, getattr(self.ctx.model.model, "generation_config", None)))
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else end_ids[0]
        report = run_rollouts(self.peft_model, self.private, self.plan.data, self.plan.loop,
                              decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                              hooks=self.ctx.hooks, pad_id=pad_id, end_ids=end_ids, resume=resume,
                              engine=self.ctx.engine, anchor=self.anchor(self.plan.data.prompt_ids))
        self._phase("train")
        return report
