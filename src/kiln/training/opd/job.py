"""On-policy distillation (OPD): prepare and run one job.

The student samples completions for each prompt (on the serving engine's
continuous batching with the job's private adapter, the sampler GRPO rollouts
share: :mod:`kiln.training.core.engine_sampling`),
the teacher scores prompt + completion once per training batch (top-K prompt
logprobs, numeric token IDs; every answer must carry the pinned fingerprint),
and the optimizer step pulls the student toward the teacher on the student's
own tokens. With ``teacher_path`` each step also trains on one row per prompt holding the teacher's greedy
answer, found through scoring calls (:mod:`kiln.training.opd.paths`), and ``until_learned`` stops the job once
those answers are the student's greedy answers.
The losses are :mod:`kiln.training.losses.opd`; one step's loss is :func:`kiln.training.opd.step.opd_loss`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from kiln.adapters.scope import revision_scope
from kiln.errors import Conflict, InvalidRequest
from kiln.runtime.chat_generation import ChatGeneration
from kiln.training.core.engine_sampling import check_samples_fit_queue, sample_policy
from kiln.training.core.plan import (JobPlan, LoraShape, PrepareContext, anchor_fields, decay_fields, lora_fields,
                                     seal_plan)
from kiln.training.core.recipe import TrainingRecipe
from kiln.training.losses.opd import outside_top_k
from kiln.training.opd.step import opd_loss, opd_pieces

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord
    from kiln.teachers.service import TeacherService
    from kiln.training.opd.schemas import OPDRequest

DEFAULT_LEARNED_EVERY_OPD = 5  # until_learned: check every this many steps (at least once per pass over the prompts)
PATHS_TENSOR = "opd_teacher_paths"  # checkpoint tensor: kiln.training.opd.paths.TeacherPaths


# ------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class OPDItem:
    student_ids: tuple[int, ...]
    teacher_ids: tuple[int, ...]
    gold_ids: tuple[int, ...] | None
    teacher_in_scope: bool = True  # False: a scoped local teacher adapter would not answer it (the base does)


@dataclass(frozen=True)
class OPDData:
    items: tuple[OPDItem, ...]
    teacher: dict[str, Any]  # the pinned registry entry (fingerprint, identity, url/kind, model_id)
    samples_per_prompt: int
    temperature: float
    top_p: float
    max_tokens: int
    top_k: int
    loss: str
    ce_weight: float
    total_steps: int
    corpus: tuple[Any, ...] = ()  # off_policy: kiln.training.opd.offline.OffPolicyRow, in file order
    teacher_path: bool = False  # one teacher-path row per prompt and step (kiln.training.opd.paths)
    rehearsal: int = 0  # questions the base model writes for rehearsal rows (kiln.training.core.rehearsal)
    rehearsal_per_prompt: int = 1  # rehearsal rows per chosen prompt and step
    gen: Any = None  # kiln.runtime.chat_generation.ChatGeneration: prompts rendered, samples' thinking budget


def _local_teacher_scope(ctx: PrepareContext, engine: Any, entry: dict[str, Any]) -> Any:
    """The routing index of a local teacher adapter's served revision when it is scoped
    (:mod:`kiln.adapters.scope`): the server answers the prompts outside its corrections with the base model, so
    the teacher does too; None for a remote teacher (its server routes), the base model or an unscoped adapter."""
    adapter = entry.get("adapter")
    if entry.get("kind") != "local" or adapter is None:
        return None
    return revision_scope(ctx.store, adapter, engine.active_adapters().get(adapter))


def prepare_opd(ctx: PrepareContext, request: OPDRequest) -> JobPlan[OPDData]:
    """Validate an OPD request against the model, the store and the teacher registry; return its plan."""
    teachers = ctx.teachers
    if teachers is None:
        raise Conflict("teachers are not available in this process", code="teachers_unavailable")
    ctx.check_adapter_name(request.adapter)
    entry = teachers.registry.pin(request.teacher)
    max_k = entry["identity"]["max_top_k"]
    if request.top_k > max_k:
        raise InvalidRequest(f"top_k={request.top_k} exceeds teacher {request.teacher!r}'s max_top_k={max_k}",
                             code="top_k_too_large", param="top_k", hint=f"use top_k <= {max_k}")
    parent = ctx.parent_of(request)
    lora = ctx.lora_shape(request, parent)
    from kiln.training.opd.schemas import budget_steps

    tok = ctx.model.tokenizer
    engine = ctx.serving_engine("OPD")
    limit = min(request.max_seq_len, engine.config.max_model_len, entry["identity"]["max_model_len"])
    if request.training_mode == "off_policy":
        return _prepare_off_policy(ctx, teachers, request, entry, lora, parent, limit)
    check_samples_fit_queue(engine, request.samples_per_prompt, "samples_per_prompt")
    gen = ChatGeneration.for_engine(engine, ctx.settings.serving, request.chat_template_kwargs, request.budget())
    eos = tok.eos_token_id
    items = []
    assert request.prompts is not None
    scope = _local_teacher_scope(ctx, engine, entry)
    for i, p in enumerate(request.prompts):
        msgs = [m.model_dump() for m in p.messages]
        s_ids = gen.prompt_ids(msgs)
        t_ids = gen.prompt_ids([m.model_dump() for m in (p.teacher_messages or [])] + msgs)
        gold = None
        if p.gold is not None:
            gold = tuple(engine.encode_text(p.gold)) + ((eos,) if eos is not None else ())
        longest = max(len(s_ids), len(t_ids)) + request.max_tokens
        if longest > limit or (gold is not None and len(s_ids) + len(gold) > limit):
            raise InvalidRequest(f"prompt {i} plus max_tokens ({longest} tokens) exceeds the limit of {limit}",
                                 code="sequence_too_long", hint="shorten the prompt or lower max_tokens")
        items.append(OPDItem(tuple(s_ids), tuple(t_ids), gold, teacher_in_scope=scope is None or scope.covers(msgs)))
    inputs = [p.model_dump(mode="json") for p in request.prompts]
    data = OPDData(tuple(items), entry, request.samples_per_prompt, request.temperature, request.top_p,
                   request.max_tokens, request.top_k, request.loss, request.ce_weight or 0.0,
                   _total_steps(request, len(items), budget=budget_steps(
                       len(items), request.batch_size, request.samples_per_prompt, request.max_tokens)),
                   teacher_path=request.teacher_path, rehearsal=request.rehearsal or 0,
                   rehearsal_per_prompt=request.rehearsal_per_prompt, gen=gen)
    return _job_plan(ctx, request, entry, lora, parent, data, inputs, {})


def _total_steps(request: OPDRequest, n_items: int, *, budget: int = 0) -> int:
    """``steps``, or: one pass over the items x ``epochs``, raised to ``budget`` steps (on-policy: the token
    budget, :func:`kiln.training.opd.schemas.budget_steps`); capped by ``max_steps``."""
    total = request.steps
    if total is None:
        total = max((request.epochs or 1) * math.ceil(n_items / request.batch_size), budget)
    return total if request.max_steps is None else min(total, request.max_steps)


def _learned_check(request: OPDRequest) -> Any:
    """``until_learned`` (default: on when ``steps`` is omitted and ``teacher_path`` is on): stop once every
    prompt's teacher path is whole and is the student's greedy answer."""
    from kiln.training.core.loop import LearnedCheck
    from kiln.training.schemas import DEFAULT_LEARNED_MARGIN

    on = request.until_learned if request.until_learned is not None else request.steps is None
    return LearnedCheck(every=DEFAULT_LEARNED_EVERY_OPD, margin=DEFAULT_LEARNED_MARGIN) \
        if on and request.teacher_path and request.training_mode == "on_policy" else None


def _prepare_off_policy(ctx: PrepareContext, teachers: TeacherService, request: OPDRequest, entry: dict[str, Any],
                        lora: LoraShape, parent: AdapterRecord | None, limit: int) -> JobPlan[OPDData]:
    """Off-policy: read and bind-check the teacher JSONL (:mod:`kiln.training.opd.offline`) before queueing."""
    from kiln.training.opd.offline import load_teacher_jsonl

    assert request.teacher_jsonl is not None
    student_tok = teachers.identity.tokenizer()[0]
    corpus = load_teacher_jsonl(ctx.settings.data_path, request.teacher_jsonl, entry,
                                student_vocab=teachers.identity.vocab_size,
                                student_tokenizer_sha256=student_tok, max_len=limit)
    data = OPDData((), entry, 1, 0.0, 1.0, 0, request.top_k, request.loss, 0.0,
                   _total_steps(request, len(corpus.rows)), corpus.rows)
    return _job_plan(ctx, request, entry, lora, parent, data, {"teacher_jsonl_sha256": corpus.sha256},
                     {"teacher_jsonl_sha256": corpus.sha256, "teacher_jsonl_rows": len(corpus.rows)})


def _job_plan(ctx: PrepareContext, request: OPDRequest, entry: dict[str, Any], lora: LoraShape,
              parent: AdapterRecord | None, data: OPDData, inputs: Any, extra: dict[str, Any]) -> JobPlan[OPDData]:
    """The effective request (binding the teacher's fingerprint and identity), its digests (resume checks the
    plan digest) and the plan."""
    from kiln.training.core.loop import Plan
    from kiln.training.opd.schemas import DEFAULT_OPD_ANCHOR_WEIGHT

    check = _learned_check(request)
    eff = request.model_dump(mode="json")
    eff.update(steps=data.total_steps, until_learned=check is not None, teacher_fingerprint=entry["fingerprint"],
               teacher_identity=entry["identity"], **lora_fields(lora, parent),
               **anchor_fields(request, default_weight=DEFAULT_OPD_ANCHOR_WEIGHT), **decay_fields(request), **extra)
    inputs_sha, plan_sha = seal_plan("opd", eff, inputs, ctx.model.base_model_sha256)
    if request.resume_from_job is not None:
        ctx.check_resumable(request.resume_from_job, plan_sha)
    loop = Plan(request.learning_rate, 1, request.batch_size, request.seed, request.checkpoint_interval,
                max_steps=data.total_steps, until_learned=check, weight_decay=eff["weight_decay"])
    return JobPlan("opd", request.adapter, eff, inputs_sha, plan_sha, lora, loop, data, parent,
                   request.auto_load, request.resume_from_job)


# ------------------------------------------------------------------------- the loop


def run_opd(peft_model: Any, name: str, data: OPDData, plan: Any, *, teacher: Any, pinned: str,
            model_id: str, vocab_size: int, hooks: Any, resume: Any, pad_id: int, end_ids: Sequence[int],
            engine: Any = None, rehearsal: Any = None, anchor: Any = None) -> Any:
    """The OPD loop: sample (student, batched) -> score (teacher, one batch) -> loss -> optimizer step.

    With the built-in ``engine`` the student samples on the serving engine's continuous batching (the private
    adapter by key, prefix cache keyed by step: :func:`~kiln.training.core.engine_sampling.sample_policy`),
    interleaved with serving; without it, one batched ``generate`` under exclusive ownership. The teacher is asked outside
    exclusive ownership (a local teacher scores on the serving engine); the step runs under it. ``rehearsal``
    (:class:`~kiln.training.core.rehearsal.Rehearsal`) adds ``rehearsal_per_prompt`` rows per chosen prompt and step,
    scored by the base model."""
    from kiln.training.core.anchor import anchor_piece, anchor_term
    from kiln.training.core.loop import Learned, TrainLoop
    from kiln.training.losses.chunked import split_causal_lm

    loop = TrainLoop(peft_model, name, plan, hooks, data.total_steps, resume)
    split = split_causal_lm(peft_model)  # logits only at completion positions, a chunk at a time
    for key in ("student_s", "teacher_s", "step_s", "sampled_tokens"):
        loop.stats.setdefault(key, 0.0)
    if data.gen is not None:  # how the prompts were rendered: thinking on or off, the budget
        loop.stats["generation"] = data.gen.describe([it.student_ids for it in data.items])
    steps = _OPDSteps(peft_model, loop, data, plan, _Scorer(teacher, data, pinned=pinned, model_id=model_id,
                                                            vocab_size=vocab_size),
                      resume=resume, pad_id=pad_id, end_ids=end_ids, engine=engine, rehearsal=rehearsal)
    check = plan.until_learned if steps.paths is not None else None
    learned = None if check is None else Learned(max(check.every, math.ceil(len(data.items) / plan.batch_size)),
                                                 steps.learned)
    def loss_step(b: Any) -> Any:
        loss = opd_loss(peft_model, split, data, *b, pad_id=pad_id, device=loop.device)
        if anchor is not None:  # the KL-to-base anchor (kiln.training.core.anchor), opt-in beside rehearsal
            loss = loss + anchor_term(anchor, peft_model, split, loop, pad_id)
        return loss

    def slicer(b: Any, limit: int) -> list[Any]:
        pieces = opd_pieces(peft_model, split, data, b, limit, pad_id=pad_id, device=loop.device)
        return pieces + ([anchor_piece(anchor, peft_model, split, loop, pad_id)] if anchor is not None else [])

    loop.train(steps, loss_step, learned=learned, slicer=slicer)
    return loop.report()


class _Scorer:
    """The pinned teacher's top-K rows of whole sequences, in one call, checked against the pin."""

    def __init__(self, teacher: Any, data: OPDData, *, pinned: str, model_id: str, vocab_size: int):
        from kiln.teachers.registry import _identity_of

        self.teacher, self.data, self.pinned = teacher, data, pinned
        self.model_id, self.vocab_size = model_id, vocab_size
        self.identity = _identity_of(data.teacher["identity"])

    def __call__(self, seqs: list[list[int]], starts: list[int], items: list[int]) -> Any:
        """Rows before ``starts`` are not used (a local teacher skips them and reuses the cached prompt: its
        ``score_from``); ``items``: each sequence's prompt, whose ``teacher_in_scope`` says whether a scoped
        local teacher adapter answers it (else the base model scores it, as the server would answer)."""
        from kiln.teachers.probe import check_answer, check_request_fits, response_cap

        top_k = self.data.top_k
        check_request_fits(self.identity, seqs, top_k)
        base = [not self.data.items[i].teacher_in_scope for i in items]
        scored = self.teacher.score(seqs, top_k, max_bytes=sum(response_cap(self.identity, len(s), top_k)
                                                               for s in seqs), vocab_size=self.vocab_size,
                                    score_from=starts, **({"base_rows": base} if any(base) else {}))
        check_answer(scored, model_id=self.model_id, pinned=self.pinned)
        return scored


class _OPDSteps:
    """OPD's steps for :meth:`TrainLoop.train`: each chosen prompt's teacher path finished, the student's samples,
    the teacher's rows of them, the rehearsal and gold rows; outside exclusive ownership."""

    def __init__(self, peft_model: Any, loop: Any, data: OPDData, plan: Any, score: _Scorer, *, resume: Any,
                 pad_id: int, end_ids: Sequence[int], engine: Any, rehearsal: Any):
        from kiln.training.opd.paths import TeacherPaths

        self.peft_model, self.loop, self.data, self.plan, self.score = peft_model, loop, data, plan, score
        self.pad_id, self.end_ids, self.engine, self.rehearsal = pad_id, end_ids, engine, rehearsal
        self.paths = TeacherPaths(len(data.items), end_ids) if data.teacher_path else None
        if self.paths is not None and resume is not None and PATHS_TENSOR in resume.tensors:
            self.paths.load_tensor(resume.tensors[PATHS_TENSOR])
        self.path_rows: dict[int, list[dict[int, float]]] = {}  # prompt -> teacher rows of its final teacher path

    def __iter__(self) -> Any:
        from kiln.training.core.loop import StepInput

        loop, data, plan, paths = self.loop, self.data, self.plan, self.paths
        while True:
            step = loop.step
            chosen = [(step * plan.batch_size + j) % len(data.items) for j in range(min(plan.batch_size,
                                                                                       len(data.items)))]
            if paths is not None:  # 0. finish the chosen prompts' teacher paths (teacher calls where unfinished)
                self._discover(chosen)
            t0 = time.perf_counter()  # 1. the student samples every prompt x sample (and the teacher-path rows)
            samples, todo = self._sample(chosen, step)
            student_s = time.perf_counter() - t0
            if not samples:
                loop.stats["student_s"] += student_s
                yield StepInput(None, tensors=_checkpoint_tensors(paths, self.rehearsal))
                continue
            t1 = time.perf_counter()  # 2. the teacher scores every (teacher prompt + completion) in one batch
            rows, sampled = self._teacher_rows(samples, todo)
            teacher_s = time.perf_counter() - t1
            # 3. the step's rows: rehearsal rows (the base model's answers, with its rows in the teacher's place)
            pairs = [(data.items[i].student_ids, comp) for i, comp in samples]
            added = self.rehearsal.add_to_step(step, len(chosen) * data.rehearsal_per_prompt, pairs, rows,
                                               sampled) if self.rehearsal is not None else 0
            # ce_weight: CE on each prompt's gold, or else on the known teacher path (sequence-level KD)
            gold = [(data.items[i].student_ids, data.items[i].gold_ids
                     or (tuple(paths.prefix(i)) if paths is not None else ())) for i in chosen] \
                if data.ce_weight > 0 else []
            yield StepInput((pairs, rows, sampled, gold), len(sampled),
                            tensors=_checkpoint_tensors(paths, self.rehearsal),
                            after=lambda: self._record(student_s, teacher_s, len(sampled) - added, added))

    def _discover(self, chosen: list[int]) -> None:
        loop, data, paths = self.loop, self.data, self.paths
        assert paths is not None
        t_d = time.perf_counter()
        dummy = self.end_ids[0] if self.end_ids else self.pad_id
        loop.stats["teacher_path_rounds"] = int(loop.stats.get("teacher_path_rounds", 0)) + paths.discover(
            chosen, data.max_tokens, lambda todo: [sc.rows[-1] or {} for sc in self.score(
                [list(data.items[i].teacher_ids) + known + [dummy] for i, known in todo],
                [len(data.items[i].teacher_ids) + len(known) for i, known in todo], [i for i, _ in todo]).prompts])
        loop.stats["teacher_s"] = round(loop.stats["teacher_s"] + time.perf_counter() - t_d, 4)

    def _sample(self, chosen: list[int], step: int) -> tuple[list[tuple[int, list[int]]], list[Any]]:
        """The student's completions of the chosen prompts (``samples_per_prompt`` each, empty ones dropped),
        then the teacher-path rows: the known prefix + the student's sample from it."""
        data, paths, plan = self.data, self.paths, self.plan
        todo = paths.rows_to_sample(chosen, data.max_tokens) if paths is not None else []
        prompts = [list(data.items[i].student_ids) for i in chosen]
        prompts += [list(data.items[i].student_ids) + known for i, known, _ in todo]
        counts = [data.samples_per_prompt] * len(chosen) + [int(left > 0) for _, _, left in todo]
        budgets = [data.max_tokens] * len(chosen) + [max(1, left) for _, _, left in todo]
        gen = data.gen  # the thinking budget on the chosen prompts' samples (not on teacher-path continuations)
        comps = sample_policy(self.peft_model, self.loop, self.engine, prompts, counts, budgets, data.temperature,
                              data.top_p, seed=plan.seed, seed_step=step, revision=f"step-{step}",
                              pad_id=self.pad_id, end_ids=self.end_ids, constrain=None if gen is None else (
                                  lambda j, ps: gen.constrain(ps, prompts[j]) if j < len(chosen) else ps))
        k = len(chosen) * data.samples_per_prompt
        samples = [(chosen[j // data.samples_per_prompt], c) for j, c in enumerate(comps[:k]) if c]
        rest = iter(comps[k:])
        samples += [(i, known + (next(rest) if left > 0 else [])) for i, known, left in todo]
        return samples, todo

    def _teacher_rows(self, samples: list[tuple[int, list[int]]], todo: list[Any]
                      ) -> tuple[list[dict[int, float]], list[int]]:
        """The teacher's rows of every sample, in one call; a final teacher path (nothing sampled after it) is
        the same sequence every step: its rows are scored once and kept."""
        data, paths = self.data, self.paths
        final = {len(samples) - len(todo) + m: i for m, (i, _, left) in enumerate(todo) if left == 0}
        ask = [k for k in range(len(samples)) if final.get(k) not in self.path_rows]
        got = dict(zip(ask, self.score([list(data.items[samples[k][0]].teacher_ids) + samples[k][1] for k in ask],
                                       [len(data.items[samples[k][0]].teacher_ids) for k in ask],
                                       [samples[k][0] for k in ask]).prompts)) \
            if ask else {}
        rows: list[dict[int, float]] = []
        sampled: list[int] = []
        for k, (i, comp) in enumerate(samples):
            if k in got:
                start = len(data.items[i].teacher_ids)
                mine = [got[k].rows[start + j] or {} for j in range(len(comp))]
                if k in final:
                    self.path_rows[i] = mine
            else:
                mine = self.path_rows[i]
            if paths is not None:
                paths.observe(i, comp, mine)
            rows += mine
            sampled += comp
        self.loop.stats["outside_top_k"] = round(outside_top_k(rows, sampled, data.top_k), 4)
        if paths is not None:
            self.loop.stats["teacher_path_tokens"] = round(paths.mean_length(), 2)
        return rows, sampled

    def _record(self, student_s: float, teacher_s: float, sampled_tokens: int, added: int) -> None:
        stats = self.loop.stats
        stats["student_s"] = round(stats["student_s"] + student_s, 4)
        stats["teacher_s"] = round(stats["teacher_s"] + teacher_s, 4)
        stats["step_s"] = round(stats["step_s"] + self.loop.last_step_s, 4)
        stats["sampled_tokens"] = int(stats["sampled_tokens"] + sampled_tokens)
        if self.rehearsal is not None:
            stats.update(rehearsal_rows=len(self.rehearsal),
                         rehearsal_tokens=stats.get("rehearsal_tokens", 0) + added)

    def learned(self) -> bool:
        """Every prompt's teacher path is whole and is the student's greedy answer (by the check's margin)."""
        from kiln.training.core.data import Row
        from kiln.training.core.loop import greedy_margin

        paths, check, data = self.paths, self.plan.until_learned, self.data
        assert paths is not None and check is not None
        if not all(paths.complete(i) for i in range(len(data.items))):
            return False
        rows = [Row(list(it.student_ids) + paths.prefix(i), [0] * len(it.student_ids) + [1] * len(paths.paths[i]))
                for i, it in enumerate(data.items)]
        margin = self.loop.forward_holds(lambda: greedy_margin(self.peft_model, rows, pad_id=self.pad_id,
                                                               batch_size=self.plan.batch_size))
        self.loop.stats["greedy_margin"] = round(margin, 4)
        return margin >= check.margin


def _checkpoint_tensors(paths: Any, rehearsal: Any) -> dict[str, torch.Tensor] | None:
    """What a checkpoint keeps besides the adapter: the teacher paths and the rehearsal questions."""
    out = {} if paths is None else {PATHS_TENSOR: paths.to_tensor()}
    return (out | rehearsal.tensors() if rehearsal is not None else out) or None



# ------------------------------------------------------------------------- the recipe


class OPDRecipe(TrainingRecipe):
    """An OPD job: re-probe the pinned teacher (before taking the accelerator), then setup -> train -> save ->
    publish (manifest kind ``opd``, config binding the teacher's fingerprint and identity) -> activate."""

    plan: JobPlan[OPDData]

    def run(self) -> dict[str, Any]:
        if not self.plan.data.corpus:  # off-policy never asks the teacher: the corpus carries its rows
            entry = self.plan.data.teacher
            registry = self._teachers().registry
            self.teacher = registry.client_for(entry)
            registry.probe(entry, self.teacher, pinned=entry["fingerprint"])
            self._phase("probe")
        return super().run()

    def receipt_teacher(self) -> dict[str, Any] | None:
        entry = self.plan.data.teacher  # the pinned registry entry: its kiln-teacher-v1 fingerprint
        return {"fingerprint": entry["fingerprint"], "alias": entry.get("alias"), "model_id": entry.get("model_id")}

    def _teachers(self) -> TeacherService:
        if self.ctx.teachers is None:
            raise Conflict("teachers are not available in this process", code="teachers_unavailable")
        return self.ctx.teachers

    def train(self, resume: Any) -> Any:
        from kiln.training.core.templates import end_of_turn_ids

        data = self.plan.data
        tok = self.ctx.model.tokenizer
        if data.corpus:
            from kiln.training.opd.offline import run_opd_offline

            report = run_opd_offline(self.peft_model, self.private, data, data.corpus, self.plan.loop,
                                     hooks=self.ctx.hooks, resume=resume,
                                     pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
            self._phase("train")
            return report
        end_ids = sorted(end_of_turn_ids(tok, getattr(self.ctx.model.model, "generation_config", None)))
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else end_ids[0]
        rehearsal = self._rehearsal(resume, pad_id, end_ids) if data.rehearsal else None
        report = run_opd(self.peft_model, self.private, data, self.plan.loop, teacher=self.teacher,
                         pinned=data.teacher["fingerprint"], model_id=self.teacher.model_id,
                         vocab_size=self._teachers().identity.vocab_size, hooks=self.ctx.hooks, resume=resume,
                         pad_id=pad_id, end_ids=end_ids, engine=self.ctx.engine, rehearsal=rehearsal,
                         anchor=self.anchor([it.student_ids for it in data.items]))
        self._phase("train")
        return report

    def _rehearsal(self, resume: Any, pad_id: int, end_ids: list[int]) -> Any:
        """The job's rehearsal rows (:func:`kiln.training.core.rehearsal.job_rehearsal`), built under exclusive
        ownership; on resume from the questions the checkpoint kept."""
        from kiln.training.core.rehearsal import REHEARSAL_TENSOR, job_rehearsal

        data, tok = self.plan.data, self.ctx.model.tokenizer
        with self.ctx.hooks.exclusive():
            return job_rehearsal(self.peft_model, lambda m: tok.apply_chat_template(m, tokenize=False),
                                 self.ctx.engine, data, seed=self.plan.loop.seed, pad_id=pad_id, end_ids=end_ids,
                                 saved=None if resume is None else resume.tensors.get(REHEARSAL_TENSOR))
