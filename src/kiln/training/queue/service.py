"""The training service: validates submissions, queues them, runs them one at a time.

The composition root (:func:`kiln.serving.state.build_training`) builds one
:class:`TrainingService` on the engine's own model; the app's lifespan starts its worker.
Every job kind comes from the registry (:mod:`kiln.training.queue.kinds`): its ``prepare``
validates a submission against :meth:`TrainingService.context`, its recipe runs it.
A job's life on the worker: claim the oldest queued job -> add a private LoRA
adapter to the served model -> train (each step under exclusive ownership) ->
write standard PEFT files into the adapter store's staging dir -> publish ->
optionally activate (the engine runs a canary first) -> delete the private adapter.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from kiln.adapters.activation import AdapterActivation
from kiln.errors import Conflict
from kiln.runtime.ownership import HoldPacer
from kiln.training.core.data import TrainingDataError
from kiln.training.core.loop import Hooks
from kiln.training.core.plan import RUN_ONLY_FIELDS, JobPlan, PrepareContext, checkpoint_root, prepare_context
from kiln.training.core.recipe import RecipeContext, published_result
from kiln.training.core.warmup import WarmUp
from kiln.training.queue import jobs as jobstates
from kiln.training.queue import kinds
from kiln.training.queue.jobs import Job, JobStore

if TYPE_CHECKING:
    from pydantic import BaseModel

    from kiln.adapters.store import AdapterRecord, AdapterStore
    from kiln.config import Settings
    from kiln.evals.service import EvalService
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel
    from kiln.runtime.memory_budget import MemoryBudget
    from kiln.teachers.service import TeacherService
    from kiln.training.core.memory_estimate import ModelDims

log = logging.getLogger("kiln.training")

WORKER_POLL_S = 1.0
MAX_YIELD_S = 1.0  # the longest gap one hold leaves serving (kiln.runtime.ownership.HoldPacer)
RECENT_JOBS = 10
WORKER_JOIN_S = 30.0
SHUTDOWN_REASON = "interrupted: the server shut down while this job was running"


class _ShutDown(Exception):
    pass


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
        self._context = prepare_context(model=model, store=store, settings=settings,
                                        check_resumable=self._check_resumable, engine=engine, jobs=self.jobs)
        self._plans: dict[str, JobPlan[Any]] = {}  # plans of jobs submitted to this process, by job ID
        self.memory: MemoryBudget | None = None  # admission by memory (set by the app)
        # auto_load / activate_on_pass (kiln.adapters.activation); the app hands in the server's one service
        self.activation = AdapterActivation(engine, store, model.base_model_sha256)
        self.observer: Any = None  # kiln.serving.metrics.Metrics: step time, tokens/s (set by the app)
        # post_eval.set_default_on_pass: (name, revision) -> pin as the server default (set by the serving root)
        self.set_default: Callable[[str, str], Any] | None = None
        self._dims: ModelDims | None = None  # computed on first use
        self.evals: EvalService | None = None  # runs post_eval gates (set_eval_service)
        self.teachers: TeacherService | None = None  # OPD jobs' teacher registry (set_teachers)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cancel_running = threading.Event()
        self._running: str | None = None
        t = settings.training
        self._cycle_s: float | None = None  # serving's recent generation cycle, from the last busy check
        # while chats wait, each hold is bounded (steps sliced to fit) and serving gets its share between holds
        self.pacer = HoldPacer(engine.ownership, self._serving_busy, serving_share=t.serving_share,
                               max_hold_ms=t.max_hold_ms, max_gap_s=MAX_YIELD_S, hold_cycles=t.hold_cycles,
                               cycle_s=self._serving_cycle_s)
        self.warm_up = WarmUp(enabled=settings.training.warm_up)
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

    # ----------------------------------------------------------- submission
    def submit(self, request: BaseModel) -> dict[str, Any]:
        plan = self.prepare(request)
        suite = (plan.request.get("locality") or {}).get("eval_suite")
        if suite and self.evals is not None:
            self.evals.suites.get(suite)  # 404 suite_not_found before queueing (the job reads it at its end)
        if self.memory is not None:  # jobs run one at a time: a running job's reservation is gone by its turn
            self.memory.check("training", "submission", self.memory_estimate(plan), what=f"the {plan.kind} job",
                              ignore_kinds=frozenset({"training"}))
        job = self.jobs.submit(plan.kind, plan.adapter, plan.request)  # QueueFullError: 503
        self._plans[job.id] = plan
        self._wake.set()
        return job.public(queue_position=self.jobs.queue_position(job))

    def context(self) -> PrepareContext:
        """What a kind's ``prepare`` checks a request against: this server's model, store, queue and teachers."""
        return replace(self._context, teachers=self.teachers)

    def prepare(self, request: BaseModel) -> JobPlan[Any]:
        """Validate everything that can be checked before the job runs; return the job's typed plan
        (:func:`kiln.training.queue.kinds.prepare`)."""
        return kinds.prepare(self.context(), request)

    def memory_estimate(self, plan: JobPlan[Any]) -> dict[str, int]:
        """Bytes the job adds beside serving, by part (:mod:`kiln.training.core.memory_estimate`)."""
        from kiln.training.core.memory_estimate import estimate_job, model_dims

        if self._dims is None:
            element = next(self.loaded.model.parameters()).element_size()
            self._dims = model_dims(self.loaded.model, element, getattr(self.loaded, "max_model_len", None))
        return estimate_job(plan.kind, plan.request, plan.data, self._dims)

    def _check_resumable(self, job_id: str, plan_sha: str, eff: dict[str, Any] | None = None) -> None:
        """``resume_from_job``: a failed or cancelled job of the same plan that left a checkpoint."""
        old = self.jobs.get(job_id)
        if old.state not in (jobstates.FAILED, jobstates.CANCELLED):
            raise Conflict(f"job {job_id} is {old.state}; only failed or cancelled jobs can be resumed", code="job_not_resumable")
        if old.request.get("plan_sha256") != plan_sha:
            what = _changed_fields(old.request, eff) if eff is not None else ""
            raise Conflict(f"this request differs from job {job_id}'s request{what}", code="resume_plan_mismatch", hint="resubmit the identical request (data, model and hyperparameters)")
        from kiln.training.core.checkpoints import list_checkpoints

        if not list_checkpoints(self._checkpoint_root(job_id)):
            raise Conflict(f"job {job_id} left no checkpoint", code="no_checkpoint", hint="set checkpoint_interval to make jobs resumable")

    def _checkpoint_root(self, job_id: str) -> Path:
        return checkpoint_root(self.root, job_id)

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
            "warm_up": self.warm_up.status(),
            "running": running[0] if running else None,
            "queued": queued,
            "queue_max": self.jobs.queue_max,
            "recent": recent,
            "pacer": self.pacer.snapshot(),
        }

    # --------------------------------------------------------------- worker
    def _worker(self) -> None:
        from kiln.runtime.threads import pin_torch_threads

        pin_torch_threads()  # before any wide engine cycle can set the process-wide count
        self.warm_up.run(self.engine, self.loaded, self.settings.locality, self._stop.is_set)
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
                from kiln.training.core.errors import JobCancelled

                if isinstance(exc, JobCancelled):
                    self.jobs.finish(job.id, jobstates.CANCELLED, error=f"cancelled at step {exc.step}")
                elif isinstance(exc, _ShutDown):
                    self.jobs.finish(job.id, jobstates.FAILED, error=f"{SHUTDOWN_REASON} ({exc})")
                else:
                    log.exception("training job %s failed", job.id)
                    self.jobs.finish(job.id, jobstates.FAILED, error=f"{type(exc).__name__}: {exc}")
            else:
                self.jobs.finish(job.id, jobstates.SUCCEEDED, result=result)
                if self.observer is not None:
                    guard = str((result.get("held_back") or {}).get("code", "")).startswith("locality_")
                    self.observer.training_locality(job.kind, result.get("locality"), guard)
            finally:
                self._running = None
                if reservation is not None and self.memory is not None:
                    self.memory.release(reservation)
                if self.observer is not None:
                    self.observer.training_tokens_per_s(0.0)

    def _serving_busy(self) -> bool:
        st = self.engine.stats()  # every engine has it (kiln.runtime.serving_engine.ServingEngine)
        cycle = st.get("cycle_s")
        self._cycle_s = None if cycle is None else float(cycle)  # read by the pacer right after (one stats call)
        return bool(st.get("active_rows") or st.get("queued_rows"))

    def _serving_cycle_s(self) -> float | None:
        """The engine's recent generation cycle in seconds, as the last busy check read it (None: not measured,
        as with the vLLM engine). HoldPacer.budget_s asks ``busy()`` first, so this is that same reading."""
        return self._cycle_s

    @contextmanager
    def _step_ownership(self) -> Iterator[None]:
        """One exclusive hold of the running job, paced against serving (:class:`HoldPacer`)."""
        try:
            with self.pacer.hold():
                yield
        finally:
            if self.observer is not None:
                self.observer.training_step(self.pacer.last_hold_s)

    def _should_cancel(self) -> bool:
        if self._stop.is_set():
            raise _ShutDown("resume it with resume_from_job if it wrote a checkpoint")
        return self._cancel_running.is_set()

    def _plan_for(self, job: Job) -> JobPlan[Any]:
        """The plan made at submission; after a restart it is rebuilt from the stored request and must
        hash to the same plan (data files and base adapters may have changed since)."""
        plan = self._plans.pop(job.id, None)
        if plan is not None:
            return plan
        schema = kinds.schema_for(job.kind)
        wire = {k: v for k, v in job.request.items() if k in schema.model_fields}
        plan = self.prepare(schema.model_validate(wire | {"resume_from_job": None}))
        if plan.plan_sha256 != job.request["plan_sha256"]:
            raise TrainingDataError(
                "the training inputs or the base adapter changed after the job was submitted; resubmit it")
        return plan

    def set_teachers(self, teachers: TeacherService | None) -> None:
        """The :class:`kiln.teachers.service.TeacherService` OPD jobs take their teachers from (set by the app)."""
        self.teachers = teachers

    def set_eval_service(self, evals: EvalService | None) -> None:
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

    def _execute(self, job: Job, plan: JobPlan[Any]) -> dict[str, Any]:
        resumed = job.request.get("resume_from_job")
        hooks = Hooks(
            exclusive=self._step_ownership,
            hold_budget=self.pacer.budget_s,
            max_hold=lambda: self.pacer.max_hold_s or None,
            layer_holds=self.settings.training.layer_holds,
            should_cancel=self._should_cancel,
            on_progress=lambda p: self._progress(job.id, p),
            checkpoint_root=self._checkpoint_root(job.id),
            plan_sha256=plan.plan_sha256,
        )
        ctx = RecipeContext(self.engine, self.store, self.loaded, hooks, self._checkpoint_root(job.id),
                            None if not resumed else self._checkpoint_root(resumed), gate=self._gate_for(job),
                            compile=self.settings.training.compile, teachers=self.teachers,
                            set_default=self.set_default, locality=self.settings.locality,
                            suites=None if self.evals is None else self.evals.suites, activation=self.activation)
        return kinds.kind_of_plan(plan).recipe(plan, ctx, job_id=job.id).run()


def _changed_fields(old: dict[str, Any], new: dict[str, Any]) -> str:
    """`` (name: old -> new, ...)`` for the plan fields two effective requests disagree on (scalars shown)."""
    skip = set(RUN_ONLY_FIELDS) | {"inputs_sha256", "plan_sha256"}
    names = sorted(k for k in set(old) | set(new) if k not in skip and old.get(k) != new.get(k))

    def show(v: Any) -> str:
        return repr(v) if v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) < 80) else "..."

    return f" ({', '.join(f'{k}: {show(old.get(k))} -> {show(new.get(k))}' for k in names[:8])})" if names else ""
