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
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kiln.canonical import canonical_json_bytes, domain_digest, sha256_file
from kiln.errors import Conflict, InvalidRequest, NotFound
from kiln.training import jobs as jobstates
from kiln.training.data import (
    TrainingDataError,
    default_epochs,
    read_sft_dataset,
    resolve_dataset_path,
    tokenize_grpo_group,
    tokenize_sft,
)
from kiln.training.jobs import Job, JobStore
from kiln.training.schemas import (
    DEFAULT_LORA_RANK,
    DEFAULT_MAX_EPOCHS,
    DEFAULT_MIN_STEPS,
    DEFAULT_TARGET_MODULES,
    GRPORequest,
    SFTRequest,
)

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


@dataclass(frozen=True)
class Prepared:
    """A fully validated job: what to train on and the effective configuration."""

    kind: str
    request: dict[str, Any]  # effective request (defaults resolved) as stored in the queue
    inputs_sha256: str
    plan_sha256: str
    rows: Any  # SFT: list[Row]; GRPO: (items, skipped)
    parent: Any  # AdapterRecord of base_adapter, or None


class TrainingService:
    def __init__(self, *, engine: Any, settings: Any, loaded: Any, adapter_store: Any | None = None):
        self.engine = engine
        self.settings = settings
        self.loaded = loaded
        self.root = settings.home_path / "training"
        self.jobs = JobStore(self.root / "jobs.sqlite3", queue_max=settings.training.queue_max)
        if adapter_store is None:
            from kiln.adapters.store import AdapterStore

            adapter_store = AdapterStore(settings.adapters_path)
        self.store = adapter_store
        self._linear_names = _linear_module_suffixes(loaded.model)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cancel_running = threading.Event()
        self._running: str | None = None
        self._last_step_s = 0.0
        self._thread = threading.Thread(target=self._worker, name="kiln-trainer", daemon=True)
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

    # ----------------------------------------------------------- submission
    def submit(self, request: SFTRequest | GRPORequest) -> dict[str, Any]:
        prepared = self.prepare(request)
        job = self.jobs.submit(prepared.kind, request.adapter, prepared.request)  # QueueFullError: 503
        self._wake.set()
        return job.public(queue_position=self.jobs.queue_position(job))

    def prepare(self, request: SFTRequest | GRPORequest) -> Prepared:
        """Validate everything that can be checked before the job runs."""
        kind = "sft" if isinstance(request, SFTRequest) else "grpo"
        tok = self.loaded.tokenizer
        served = {self.loaded.model_id}
        if request.adapter in served:
            raise InvalidRequest(f"{request.adapter!r} is the base model's ID", code="invalid_adapter_name", hint="choose another adapter name")
        parent = None
        if request.base_adapter is not None:
            parent = self._lookup_adapter(request.base_adapter)
        rank, alpha, targets = self._lora_shape(request, parent)

        eff = request.model_dump(mode="json")
        if isinstance(request, SFTRequest):
            examples = request.examples
            if request.dataset_path is not None:
                path = resolve_dataset_path(self.settings.data_path, request.dataset_path)
                examples = read_sft_dataset(path, max_examples=self.settings.training.max_examples)
                eff["dataset_sha256"] = sha256_file(path)[0]
            assert examples is not None
            if len(examples) > self.settings.training.max_examples:
                raise TrainingDataError(f"{len(examples)} examples exceed training.max_examples",
                                        code="too_many_examples")
            rows: Any = tokenize_sft(tok, examples, max_seq_len=request.max_seq_len)
            inputs = [e.model_dump(mode="json") for e in examples]
            n_items = len(rows)
        else:
            from kiln.training.trainer import grpo_items

            grouped = [tokenize_grpo_group(tok, g, max_seq_len=request.max_seq_len) for g in request.groups]
            rewards = [[c.reward for c in g.completions] for g in request.groups]
            items, skipped = grpo_items(grouped, rewards, scale_rewards=request.scale_rewards)
            if not items:
                raise TrainingDataError(
                    f"all {skipped} groups have identical rewards within each group; GRPO has nothing to learn",
                    code="zero_variance_groups", hint="give each group completions with different rewards",
                )
            rows = (items, skipped)
            inputs = [g.model_dump(mode="json") for g in request.groups]
            n_items = len(items)

        eff.update(
            epochs=request.epochs or default_epochs(n_items, request.batch_size, min_steps=DEFAULT_MIN_STEPS,
                                                    max_epochs=DEFAULT_MAX_EPOCHS),
            lora_rank=rank, lora_alpha=alpha, lora_target_modules=targets,
            base_adapter_revision=None if parent is None else parent.revision,
        )
        inputs_sha = domain_digest(INPUTS_DOMAIN, kind.encode(), canonical_json_bytes(inputs))
        plan_fields = {k: v for k, v in eff.items() if k not in ("resume_from_job", "auto_load", "checkpoint_interval")}
        plan_sha = domain_digest(PLAN_DOMAIN, canonical_json_bytes(
            {"kind": kind, "config": plan_fields, "inputs_sha256": inputs_sha,
             "base_model_sha256": self.loaded.base_model_sha256}))
        eff["inputs_sha256"], eff["plan_sha256"] = inputs_sha, plan_sha
        if request.resume_from_job is not None:
            self._check_resumable(request.resume_from_job, plan_sha)
        return Prepared(kind, eff, inputs_sha, plan_sha, rows, parent)

    def _lookup_adapter(self, name: str) -> Any:
        from kiln.adapters.errors import AdapterNotFound

        try:
            record = self.store.get(name)
        except AdapterNotFound:
            raise NotFound(f"base_adapter {name!r} is not in the adapter store", code="adapter_not_found", hint="list adapters with GET /v1/adapters") from None
        base = record.manifest.base_model_sha256
        if base != self.loaded.base_model_sha256:
            raise Conflict(f"adapter {name!r} was trained on another base model ({base})", code="adapter_base_mismatch", hint="continue from an adapter of the served model")
        return record

    def _lora_shape(self, request: Any, parent: Any) -> tuple[int, float, list[str]]:
        if parent is not None:
            import json

            cfg = json.loads((Path(parent.path) / "adapter_config.json").read_text("utf-8"))
            shape = (int(cfg["r"]), float(cfg["lora_alpha"]), sorted(cfg["target_modules"]))
            asked = (request.lora_rank, request.lora_alpha, request.lora_target_modules)
            for given, have, label in zip(asked, shape, ("lora_rank", "lora_alpha", "lora_target_modules")):
                if given is not None and given != have:
                    raise InvalidRequest(f"{label}={given!r} differs from base_adapter {parent.name!r} ({have!r})", code="lora_config_conflict", hint="omit the LoRA fields when continuing from a base adapter")
            return shape
        rank = request.lora_rank or DEFAULT_LORA_RANK
        alpha = float(request.lora_alpha if request.lora_alpha is not None else 2 * rank)
        targets = request.lora_target_modules or sorted(DEFAULT_TARGET_MODULES)
        missing = [t for t in targets if t not in self._linear_names]
        if missing:
            raise InvalidRequest(f"the model has no linear modules named {missing}", code="unknown_target_modules", hint=f"choose among {sorted(self._linear_names)}")
        return rank, alpha, targets

    def _check_resumable(self, job_id: str, plan_sha: str) -> None:
        old = self.jobs.get(job_id)
        if old.state not in (jobstates.FAILED, jobstates.CANCELLED):
            raise Conflict(f"job {job_id} is {old.state}; only failed or cancelled jobs can be resumed", code="job_not_resumable")
        if old.request.get("plan_sha256") != plan_sha:
            raise Conflict(f"this request differs from job {job_id}'s request", code="resume_plan_mismatch", hint="resubmit the identical request (data, model and hyperparameters)")
        from kiln.training.checkpoints import list_checkpoints

        if not list_checkpoints(self._checkpoint_root(job_id)):
            raise Conflict(f"job {job_id} left no checkpoint", code="no_checkpoint", hint="set checkpoint_interval to make jobs resumable")

    def _checkpoint_root(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id / "checkpoints"

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
        while not self._stop.is_set():
            job = self.jobs.claim_next()
            if job is None:
                self._wake.wait(WORKER_POLL_S)
                self._wake.clear()
                continue
            self._running = job.id
            self._cancel_running.clear()
            try:
                result = self._execute(job)
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

    def _serving_busy(self) -> bool:
        stats = getattr(self.engine, "stats", None)
        if stats is None:
            return False
        st = stats()
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

    def _should_cancel(self) -> bool:
        if self._stop.is_set():
            raise _ShutDown("resume it with resume_from_job if it wrote a checkpoint")
        return self._cancel_running.is_set()

    def _execute(self, job: Job) -> dict[str, Any]:
        from safetensors.torch import load_file

        from kiln.training.checkpoints import latest_checkpoint
        from kiln.training.trainer import (
            GRPOSettings,
            Hooks,
            Plan,
            add_private_adapter,
            lora_config,
            run_grpo,
            run_sft,
            save_adapter_files,
        )

        t_start = time.perf_counter()
        req = job.request
        schema = SFTRequest if job.kind == "sft" else GRPORequest
        wire = {k: v for k, v in req.items() if k in schema.model_fields}
        prepared = self.prepare(schema.model_validate(wire | {"resume_from_job": None}))
        if prepared.plan_sha256 != req["plan_sha256"]:
            raise TrainingDataError(
                "the training inputs or the base adapter changed after the job was submitted; resubmit it")
        eff = prepared.request
        plan = Plan(eff["learning_rate"], eff["epochs"], eff["batch_size"], eff["seed"], req["checkpoint_interval"])
        resume = None
        if req.get("resume_from_job"):
            resume = latest_checkpoint(self._checkpoint_root(req["resume_from_job"]), plan_sha256=prepared.plan_sha256)
        init_state = None
        if prepared.parent is not None:
            init_state = load_file(str(Path(prepared.parent.path) / "adapter_model.safetensors"))

        ownership = self.engine.ownership
        peft_model = self.engine.peft_model()
        private = f"kiln-{job.id}"
        config = lora_config(eff["lora_rank"], eff["lora_alpha"], eff["lora_target_modules"])
        hooks = Hooks(
            exclusive=self._step_ownership,
            should_cancel=self._should_cancel,
            on_progress=lambda p: self.jobs.update_progress(job.id, p),
            checkpoint_root=self._checkpoint_root(job.id),
            plan_sha256=prepared.plan_sha256,
        )
        pad_id = self.loaded.tokenizer.pad_token_id
        with ownership.exclusive():
            add_private_adapter(peft_model, private, config, seed=plan.seed, init_state=init_state)
        staging = None
        try:
            t_train = time.perf_counter()
            if job.kind == "sft":
                report = run_sft(peft_model, private, prepared.rows, plan, pad_id=pad_id, hooks=hooks, resume=resume)
            else:
                items, skipped = prepared.rows
                settings = GRPOSettings(eff["clip_epsilon"], eff["scale_rewards"], eff["kl_coef"], eff["kl_estimator"])
                report = run_grpo(peft_model, private, items, plan, settings, pad_id=pad_id, skipped_groups=skipped,
                                  hooks=hooks, resume=resume)
            t_publish = time.perf_counter()
            staging = self.store.new_staging()
            save_adapter_files(peft_model, private, staging.path, base_model_dir=str(self.loaded.path))
        except BaseException:
            if staging is not None:
                staging.discard()
            raise
        finally:
            self.engine.delete_private_adapter(private)
        manifest_config = {k: v for k, v in eff.items()
                           if k not in ("examples", "groups", "inputs_sha256", "plan_sha256", "resume_from_job")}
        record = self.store.publish(
            staging, name=job.adapter, base_model_sha256=self.loaded.base_model_sha256, kind=job.kind,
            config=manifest_config, inputs_sha256=prepared.inputs_sha256,
            parent_revision=eff["base_adapter_revision"], base_model_dir=self.loaded.info,
        )
        t_activate = time.perf_counter()
        if req.get("auto_load"):
            self.engine.activate_adapter(record.name, Path(record.path), record.revision)
        t_end = time.perf_counter()
        return {
            "adapter": record.name,
            "revision": record.revision,
            "path": str(record.path),
            "activated": bool(req.get("auto_load")),
            "resumed_from_step": None if resume is None else resume.step,
            "report": report.as_dict(),
            "timings_s": {
                "prepare": round(t_train - t_start, 4),
                "train": round(t_publish - t_train, 4),
                "publish": round(t_activate - t_publish, 4),
                "activate": round(t_end - t_activate, 4),
                "total": round(t_end - t_start, 4),
            },
        }


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
    """Create the training service on ``state.engine`` and start its worker; sets ``state.trainer``."""
    loaded = getattr(state, "loaded", None) or state.model  # the app's KilnState calls it `model`
    service = TrainingService(engine=state.engine, settings=state.settings, loaded=loaded)
    service.start()
    state.trainer = service
