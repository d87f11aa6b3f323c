"""The training service: validates submissions, queues them, runs them one at a time.

``attach_training(state)`` (called by the app at start-up) builds a
:class:`TrainingService` on the engine's own model and starts its worker thread.
A job's life on the worker: claim the oldest queued job -> add a private LoRA
adapter to the served model -> train (each step under exclusive ownership) ->
write standard PEFT files into the adapter store's staging dir -> publish ->
optionally activate (the engine runs a canary first) -> delete the private adapter.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from kiln.canonical import canonical_json_bytes, domain_digest
from kiln.errors import Conflict, InvalidRequest, NotFound
from kiln.training import jobs as jobstates
from kiln.training.data import (
    TrainingDataError,
    batches_per_epoch,
    default_epochs,
    load_sft_dataset,
    tokenize_grpo_group,
    tokenize_sft,
)
from kiln.training.jobs import Job, JobStore
from kiln.training.recipe import (
    RUN_ONLY_FIELDS,
    GRPOData,
    JobPlan,
    LoraShape,
    RecipeContext,
    TrainingRecipe,
    lora_shape_of,
    published_result,
)
from kiln.training.schemas import (
    DEFAULT_LEARNED_MAX_STEPS,
    DEFAULT_LORA_RANK,
    DEFAULT_MAX_EPOCHS,
    DEFAULT_MIN_STEPS,
    DEFAULT_TARGET_MODULES,
    LINEAR_ATTENTION_TARGET_MODULES,
    MAX_EPOCHS,
    ROLLOUT_FIELDS,
    GRPORequest,
    SFTRequest,
)
from kiln.training.templates import end_of_turn_ids
from kiln.training.trainer import GRPOSettings, Hooks, LearnedCheck, Plan, grpo_items

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord, AdapterStore
    from kiln.config import Settings
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel

log = logging.getLogger("kiln.training")

INPUTS_DOMAIN = "kiln.training-inputs.v1"
PLAN_DOMAIN = "kiln.training-plan.v1"
WORKER_POLL_S = 1.0
# While requests are in flight, training steps take at most this share of the
# time: after a step of d seconds the worker leaves the device to serving for
# d * (1 - share) / share (capped) before it asks for exclusive ownership again.
TRAINING_SHARE_WHILE_SERVING = 0.25
MAX_YIELD_S = 1.0
RECENT_JOBS = 10
WORKER_JOIN_S = 30.0
SHUTDOWN_REASON = "interrupted: the server shut down while this job was running"


class _ShutDown(Exception):
    pass


Prepared = JobPlan  # the name this module used before the recipe split


class TrainingService:
    """The training queue and its worker thread, on the engine's own model.

    Built once by the application's composition root; ``start()`` starts the
    worker, ``close()`` stops it. It never touches the application state.
    """

    def __init__(self, *, engine: Engine, store: AdapterStore, settings: Settings, model: LoadedModel):
        self.engine = engine
        self.store = store
        self.settings = settings
        self.loaded = model
        self.root = settings.home_path / "training"
        self.jobs = JobStore(self.root / "jobs.sqlite3", queue_max=settings.training.queue_max,
                             reconcile=self._published_result)
        self._linear_names = _linear_module_suffixes(model.model)
        self._end_ids = end_of_turn_ids(model.tokenizer, getattr(model.model, "generation_config", None))
        self._plans: dict[str, JobPlan] = {}  # plans of jobs submitted to this process, by job ID
        self.memory: Any = None  # kiln.runtime.memory_budget.MemoryBudget: admission by memory (set by the app)
        self.observer: Any = None  # kiln.serving.metrics.Metrics: step time, tokens/s (set by the app)
        self._dims: Any = None  # kiln.training.memory_estimate.ModelDims, computed on first use
        self.evals: Any = None  # kiln.evals.service.EvalService for post_eval gates (set_eval_service)
        self.teachers: Any = None  # kiln.teachers.service.TeacherService for OPD jobs (set_teachers)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cancel_running = threading.Event()
        self._running: str | None = None
        self._last_step_s = 0.0
        self._thread = threading.Thread(target=self._worker, name="kiln-trainer", daemon=True)
        if self.jobs.reconciled:
            log.warning("job(s) published before the previous shutdown marked succeeded: %s",
                        ", ".join(self.jobs.reconciled))
        if self.jobs.recovered:
            log.warning("failed %d job(s) interrupted by the previous shutdown: %s", len(self.jobs.recovered),
                        ", ".join(self.jobs.recovered))

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the worker (a running job fails with a resume hint) and close the queue."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(WORKER_JOIN_S)
        self.jobs.close()

    @property
    def running_job(self) -> str | None:
        """The ID of the job the worker runs now, if any."""
        return self._running

    @property
    def max_seq_len_limit(self) -> int | None:
        """The longest sequence the model supports (``max_position_embeddings``), if it says."""
        return getattr(self.loaded, "max_model_len", None)

    # ----------------------------------------------------------- submission
    def submit(self, request: SFTRequest | GRPORequest) -> dict[str, Any]:
        plan = self.prepare(request)
        if self.memory is not None:  # jobs run one at a time: a running job's reservation is gone by its turn
            self.memory.check("training", "submission", self.memory_estimate(plan), what=f"the {plan.kind} job",
                              ignore_kinds=frozenset({"training"}))
        job = self.jobs.submit(plan.kind, request.adapter, plan.request)  # QueueFullError: 503
        self._plans[job.id] = plan
        self._wake.set()
        return job.public(queue_position=self.jobs.queue_position(job))

    def prepare(self, request: SFTRequest | GRPORequest) -> JobPlan:
        """Validate everything that can be checked before the job runs; return the job's typed plan."""
        from kiln.training.opd_schemas import OPDRequest

        if isinstance(request, OPDRequest):
            from kiln.training.opd import prepare_opd

            return prepare_opd(self, request)
        from kiln.training.kd_schemas import KDRequest

        if isinstance(request, KDRequest):
            from kiln.training.kd_job import prepare_kd

            return prepare_kd(self, request)
        if isinstance(request, GRPORequest) and request.prompts is not None:
            from kiln.training.grpo_rollouts import prepare_rollouts

            return prepare_rollouts(self, request)  # Kiln samples and scores the groups itself
        tok = self.loaded.tokenizer
        if request.adapter == self.loaded.model_id:
            raise InvalidRequest(f"{request.adapter!r} is the base model's ID", code="invalid_adapter_name", hint="choose another adapter name")
        parent = None if request.base_adapter is None else self._lookup_adapter(request.base_adapter)
        lora = self._lora_shape(request, parent)
        max_len = request.max_seq_len
        if self.max_seq_len_limit is not None:
            max_len = min(max_len, self.max_seq_len_limit)

        eff = request.model_dump(mode="json")
        rows: tuple[Any, ...] | GRPOData
        if isinstance(request, SFTRequest):
            kind = "sft"
            examples = request.examples
            if request.dataset_path is not None:
                examples, eff["dataset_sha256"] = load_sft_dataset(
                    self.settings.data_path, request.dataset_path, max_examples=self.settings.training.max_examples)
            assert examples is not None
            if len(examples) > self.settings.training.max_examples:
                raise TrainingDataError(f"{len(examples)} examples exceed training.max_examples",
                                        code="too_many_examples")
            rows = tuple(tokenize_sft(tok, examples, max_seq_len=max_len, end_ids=self._end_ids))
            inputs = [e.model_dump(mode="json") for e in examples]
            n_items = len(rows)
        else:
            kind = "grpo"
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
            rows = GRPOData(tuple(items), skipped, GRPOSettings(request.clip_epsilon, request.scale_rewards,
                                                                request.kl_coef, request.kl_estimator))
            inputs = [g.model_dump(mode="json") for g in request.groups]
            n_items = len(items)

        until_learned = kind == "sft" and (request.until_learned if getattr(request, "until_learned", None)
                                           is not None else request.epochs is None)
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
        eff.update(epochs=epochs, max_steps=max_steps, max_seq_len=max_len, lora_rank=lora.rank,
                   lora_alpha=lora.alpha, lora_target_modules=list(lora.target_modules),
                   base_adapter_revision=None if parent is None else parent.revision)
        if kind == "sft":
            eff["until_learned"] = until_learned
        inputs_sha = domain_digest(INPUTS_DOMAIN, kind.encode(), canonical_json_bytes(inputs))
        plan_fields = {k: v for k, v in eff.items() if k not in RUN_ONLY_FIELDS}
        plan_sha = domain_digest(PLAN_DOMAIN, canonical_json_bytes(
            {"kind": kind, "config": plan_fields, "inputs_sha256": inputs_sha,
             "base_model_sha256": self.loaded.base_model_sha256}))
        eff["inputs_sha256"], eff["plan_sha256"] = inputs_sha, plan_sha
        if request.resume_from_job is not None:
            self._check_resumable(request.resume_from_job, plan_sha, eff)
        check = None
        if until_learned:
            check = LearnedCheck(every=request.learned_check_every, margin=request.learned_margin)  # type: ignore[union-attr]
        loop = Plan(request.learning_rate, epochs, request.batch_size, request.seed, request.checkpoint_interval,
                    max_steps=max_steps, until_learned=check)
        return JobPlan(kind, request.adapter, eff, inputs_sha, plan_sha, lora, loop, rows, parent,
                       request.auto_load, request.resume_from_job)

    def memory_estimate(self, plan: JobPlan) -> dict[str, int]:
        """Bytes the job adds beside serving, by part (:mod:`kiln.training.memory_estimate`)."""
        from kiln.training.memory_estimate import estimate_job, model_dims

        if self._dims is None:
            element = next(self.loaded.model.parameters()).element_size()
            self._dims = model_dims(self.loaded.model, element, self.max_seq_len_limit)
        return estimate_job(plan.kind, plan.request, plan.rows, self._dims)

    def _lookup_adapter(self, name: str) -> AdapterRecord:
        from kiln.adapters.errors import AdapterNotFound

        try:
            record = self.store.get(name)
        except AdapterNotFound:
            raise NotFound(f"base_adapter {name!r} is not in the adapter store", code="adapter_not_found", hint="list adapters with GET /v1/adapters") from None
        base = record.manifest.base_model_sha256
        if base != self.loaded.base_model_sha256:
            raise Conflict(f"adapter {name!r} was trained on another base model ({base})", code="adapter_base_mismatch", hint="continue from an adapter of the served model")
        return record

    def _lora_shape(self, request: SFTRequest | GRPORequest, parent: AdapterRecord | None) -> LoraShape:
        if parent is not None:
            shape = lora_shape_of(parent.path)
            asked = (request.lora_rank, request.lora_alpha, request.lora_target_modules)
            have = (shape.rank, shape.alpha, list(shape.target_modules))
            for given, had, label in zip(asked, have, ("lora_rank", "lora_alpha", "lora_target_modules")):
                if given is not None and given != had:
                    raise InvalidRequest(f"{label}={given!r} differs from base_adapter {parent.name!r} ({had!r})", code="lora_config_conflict", hint="omit the LoRA fields when continuing from a base adapter")
            return shape
        rank = request.lora_rank or DEFAULT_LORA_RANK
        alpha = float(request.lora_alpha if request.lora_alpha is not None else 2 * rank)
        targets = request.lora_target_modules or default_target_modules(self._linear_names)
        missing = [t for t in targets if t not in self._linear_names]
        if missing:
            raise InvalidRequest(f"the model has no linear modules named {missing}", code="unknown_target_modules", hint=f"choose among {sorted(self._linear_names)}")
        return LoraShape(rank, alpha, tuple(targets))

    def _check_resumable(self, job_id: str, plan_sha: str, eff: dict[str, Any] | None = None) -> None:
        old = self.jobs.get(job_id)
        if old.state not in (jobstates.FAILED, jobstates.CANCELLED):
            raise Conflict(f"job {job_id} is {old.state}; only failed or cancelled jobs can be resumed", code="job_not_resumable")
        if old.request.get("plan_sha256") != plan_sha:
            what = _changed_fields(old.request, eff) if eff is not None else ""
            raise Conflict(f"this request differs from job {job_id}'s request{what}", code="resume_plan_mismatch", hint="resubmit the identical request (data, model and hyperparameters)")
        from kiln.training.checkpoints import list_checkpoints

        if not list_checkpoints(self._checkpoint_root(job_id)):
            raise Conflict(f"job {job_id} left no checkpoint", code="no_checkpoint", hint="set checkpoint_interval to make jobs resumable")

    def _checkpoint_root(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id / "checkpoints"

    def _published_result(self, job: Job) -> dict[str, Any] | None:
        """For a job left running by a dead process: its result if its adapter was published."""
        from kiln.adapters.errors import AdapterNotFound

        try:
            record = self.store.get(job.adapter)
        except (AdapterNotFound, ValueError):
            return None
        return published_result(record) if record.manifest.config.get("job_id") == job.id else None

    # -------------------------------------------------------------- queries
    def cancel(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.cancel(job_id)
        if job.state == jobstates.RUNNING and self._running == job_id:
            self._cancel_running.set()
        return job.public()

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        return job.public(queue_position=self.jobs.queue_position(job))

    def status(self) -> dict[str, Any]:
        active = self.jobs.list(states=frozenset({jobstates.QUEUED, jobstates.RUNNING}))
        running = [j.public() for j in active if j.state == jobstates.RUNNING]
        queued = [j.public(queue_position=i + 1) for i, j in enumerate(a for a in active if a.state == jobstates.QUEUED)]
        recent = [j.public() for j in self.jobs.list(states=jobstates.TERMINAL, limit=RECENT_JOBS, newest=True)]
        return {
            "enabled": True,
            "worker_alive": self._thread.is_alive(),
            "running": running[0] if running else None,
            "queued": queued,
            "queue_max": self.jobs.queue_max,
            "recent": recent,
        }

    # --------------------------------------------------------------- worker
    def _worker(self) -> None:
        from kiln.runtime.threads import pin_torch_threads

        pin_torch_threads()  # before any wide engine cycle can set the process-wide count
        while not self._stop.is_set():
            job = self.jobs.claim_next()
            if job is None:
                self._wake.wait(WORKER_POLL_S)
                self._wake.clear()
                continue
            self._running = job.id
            self._cancel_running.clear()
            reservation = None
            try:
                plan = self._plan_for(job)
                if self.memory is not None:  # held while the job runs; released however it ends
                    reservation = self.memory.reserve("training", job.id, self.memory_estimate(plan),
                                                      what=f"{plan.kind} job {job.id}")
                result = self._execute(job, plan)
            except Exception as exc:  # noqa: BLE001 - the job records any failure
                from kiln.training.trainer import JobCancelled

                if isinstance(exc, JobCancelled):
                    self.jobs.finish(job.id, jobstates.CANCELLED, error=f"cancelled at step {exc.step}")
                elif isinstance(exc, _ShutDown):
                    self.jobs.finish(job.id, jobstates.FAILED, error=f"{SHUTDOWN_REASON} ({exc})")
                else:
                    log.exception("training job %s failed", job.id)
                    self.jobs.finish(job.id, jobstates.FAILED, error=f"{type(exc).__name__}: {exc}")
            else:
                self.jobs.finish(job.id, jobstates.SUCCEEDED, result=result)
            finally:
                self._running = None
                if reservation is not None:
                    self.memory.release(reservation)
                if self.observer is not None:
                    self.observer.training_tokens_per_s(0.0)

    def _serving_busy(self) -> bool:
        st = self.engine.stats()  # every engine has it (kiln.runtime.serving_engine.ServingEngine)
        return bool(st.get("active_rows") or st.get("queued_rows"))

    @contextmanager
    def _step_ownership(self) -> Iterator[None]:
        """Exclusive ownership for one training step, yielding to serving first when it is busy."""
        if self._last_step_s and self._serving_busy():
            share = TRAINING_SHARE_WHILE_SERVING
            time.sleep(min(MAX_YIELD_S, self._last_step_s * (1 - share) / share))
        with self.engine.ownership.exclusive():
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._last_step_s = time.perf_counter() - t0
                if self.observer is not None:
                    self.observer.training_step(self._last_step_s)

    def _should_cancel(self) -> bool:
        if self._stop.is_set():
            raise _ShutDown("resume it with resume_from_job if it wrote a checkpoint")
        return self._cancel_running.is_set()

    def _plan_for(self, job: Job) -> JobPlan:
        """The plan made at submission; after a restart it is rebuilt from the stored request and must
        hash to the same plan (data files and base adapters may have changed since)."""
        plan = self._plans.pop(job.id, None)
        if plan is not None:
            return plan
        from kiln.training.kd_schemas import KDRequest
        from kiln.training.opd_schemas import OPDRequest

        schema = {"sft": SFTRequest, "grpo": GRPORequest, "opd": OPDRequest, "kd": KDRequest}[job.kind]
        wire = {k: v for k, v in job.request.items() if k in schema.model_fields}
        plan = self.prepare(schema.model_validate(wire | {"resume_from_job": None}))
        if plan.plan_sha256 != job.request["plan_sha256"]:
            raise TrainingDataError(
                "the training inputs or the base adapter changed after the job was submitted; resubmit it")
        return plan

    def set_teachers(self, teachers: Any) -> None:
        """The :class:`kiln.teachers.service.TeacherService` OPD jobs take their teachers from (set by the app)."""
        self.teachers = teachers

    def set_eval_service(self, evals: Any) -> None:
        """The :class:`kiln.evals.service.EvalService` that runs ``post_eval`` gates (set by the app)."""
        self.evals = evals

    def _gate_for(self, job: Job) -> Any:
        evals = self.evals
        if evals is None:
            return None
        from kiln.evals.schemas import AdapterRef, PostEval

        def gate(record: AdapterRecord, post_eval: dict[str, Any]) -> dict[str, Any]:
            def record_ids(ids: dict[str, Any]) -> None:  # the eval run IDs appear on the job at once
                self.jobs.update_progress(job.id, self.jobs.get(job.id).progress | {"post_eval": ids})

            return evals.post_train_gate(AdapterRef(adapter=record.name, revision=record.revision),
                                         PostEval.model_validate(post_eval), on_runs=record_ids)

        return gate

    def _progress(self, job_id: str, progress: dict[str, Any]) -> None:
        self.jobs.update_progress(job_id, progress)
        if self.observer is not None and progress.get("tokens_per_s") is not None:
            self.observer.training_tokens_per_s(float(progress["tokens_per_s"]))

    def _execute(self, job: Job, plan: JobPlan) -> dict[str, Any]:
        resumed = job.request.get("resume_from_job")
        hooks = Hooks(
            exclusive=self._step_ownership,
            should_cancel=self._should_cancel,
            on_progress=lambda p: self._progress(job.id, p),
            checkpoint_root=self._checkpoint_root(job.id),
            plan_sha256=plan.plan_sha256,
        )
        ctx = RecipeContext(self.engine, self.store, self.loaded, hooks, self._checkpoint_root(job.id),
                            None if not resumed else self._checkpoint_root(resumed), gate=self._gate_for(job),
                            compile=self.settings.training.compile)
        if plan.kind == "opd":
            from kiln.training.opd import make_opd_recipe

            return make_opd_recipe(plan, ctx, job_id=job.id, teachers=self.teachers).run()
        if plan.kind == "kd":
            from kiln.training.kd_job import make_kd_recipe

            return make_kd_recipe(plan, ctx, job_id=job.id).run()
        if plan.kind == "grpo" and plan.request.get("prompts") is not None:
            from kiln.training.grpo_rollouts import make_rollout_recipe

            return make_rollout_recipe(plan, ctx, job_id=job.id).run()
        return TrainingRecipe(plan, ctx, job_id=job.id).run()


def _changed_fields(old: dict[str, Any], new: dict[str, Any]) -> str:
    """`` (name: old -> new, ...)`` for the plan fields two effective requests disagree on (scalars shown)."""
    skip = set(RUN_ONLY_FIELDS) | {"inputs_sha256", "plan_sha256"}
    names = sorted(k for k in set(old) | set(new) if k not in skip and old.get(k) != new.get(k))

    def show(v: Any) -> str:
        return repr(v) if v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) < 80) else "..."

    return f" ({', '.join(f'{k}: {show(old.get(k))} -> {show(new.get(k))}' for k in names[:8])})" if names else ""


def default_target_modules(linear_names: set[str]) -> list[str]:
    """The attention projections, plus the Gated DeltaNet ones when the model has those layers."""
    targets = set(DEFAULT_TARGET_MODULES)
    if {"in_proj_qkv", "in_proj_z"} <= linear_names:  # a Qwen3.5 hybrid's linear-attention layers
        targets |= {m for m in LINEAR_ATTENTION_TARGET_MODULES if m in linear_names}
    return sorted(targets)


def _linear_module_suffixes(model: Any) -> set[str]:
    import torch

    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lora_" not in name:
            parts = name.split(".")
            if parts[-1] == "base_layer":  # already wrapped by PEFT
                parts = parts[:-1]
            names.add(parts[-1])
    return names - {"lm_head"}


def attach_training(state: Any) -> None:
    """Create the training service on ``state.engine`` and start its worker; sets ``state.trainer``.

    Kept until the application's composition root builds :class:`TrainingService` itself.
    """
    from kiln.adapters.store import AdapterStore

    loaded = getattr(state, "loaded", None) or state.model  # the app's KilnState calls it `model`
    store = getattr(state, "adapter_store", None) or AdapterStore(state.settings.adapters_path)
    service = TrainingService(engine=state.engine, store=store, settings=state.settings, model=loaded)
    service.start()
    state.trainer = service
