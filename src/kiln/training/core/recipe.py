"""One training job as a recipe: a typed plan in, then setup -> train -> save -> publish -> activate.

:class:`~kiln.training.core.plan.JobPlan` is everything a job needs, validated once at submission
by its kind's ``prepare`` (:mod:`kiln.training.queue.kinds`). :class:`TrainingRecipe` runs it on the
served model, in the spirit of torchtune's single-device recipes: each phase is one method, called
in order by :meth:`TrainingRecipe.run`; each kind's recipe (``SFTRecipe`` in :mod:`kiln.training.sft.job`,
``GRPORecipe`` in :mod:`kiln.training.grpo.job`, the rollout, OPD and KD recipes beside their loops)
defines only :meth:`TrainingRecipe.train`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kiln.adapters.receipt import training_claims
from kiln.adapters.validate import WEIGHTS_FILE
from kiln.training.core.checkpoints import Checkpoint, latest_checkpoint
from kiln.training.core.loop import Hooks, Plan, Report
from kiln.training.core.lora import add_private_adapter, lora_config, save_adapter_files
from kiln.training.core.plan import JobPlan

if TYPE_CHECKING:
    from kiln.adapters.activation import AdapterActivation
    from kiln.adapters.store import AdapterRecord, AdapterStore, Staging
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel
    from kiln.teachers.service import TeacherService

log = logging.getLogger("kiln.training")


@dataclass(frozen=True)
class RecipeContext:
    """What a recipe runs against: the served model, the store, and the worker's hooks."""

    engine: Engine
    store: AdapterStore
    model: LoadedModel
    hooks: Hooks
    checkpoints: Path  # this job's checkpoint root
    resume_checkpoints: Path | None  # the resumed job's checkpoint root
    # post-train gate: (published record, request's post_eval) -> verdict dict (kiln.evals); None: no evals
    gate: Callable[[AdapterRecord, dict[str, Any]], dict[str, Any]] | None = None
    compile: bool = False  # `training.compile`: torch.compile the trunk (docs/training.md, "Speed and memory")
    teachers: TeacherService | None = None  # OPD: the teacher registry its pinned teacher is re-probed in
    # post_eval.set_default_on_pass: (name, revision) -> pin it as the server default (set by the serving root)
    set_default: Callable[[str, str], Any] | None = None
    locality: Any = None  # settings.locality (kiln.config.LocalitySettings); None: its defaults
    suites: Any = None  # the eval suite store a job's locality.eval_suite is read from (None: no evals)
    # the server's activation service (kiln.adapters.activation); None: one over this engine and store, no memory
    activation: AdapterActivation | None = None


class TrainingRecipe:
    """Runs one :class:`JobPlan` on the engine's model; :meth:`run` reads top to bottom.

    A kind's recipe subclasses it and defines :meth:`train` (the other phases are shared)."""

    def __init__(self, plan: JobPlan[Any], ctx: RecipeContext, *, job_id: str):
        self.plan, self.ctx, self.job_id = plan, ctx, job_id
        self.private = f"kiln-{job_id}"
        self.timings: dict[str, float] = {}
        self.activated = False
        self.default_set = False  # post_eval.set_default_on_pass pinned this revision as the server default
        self.post_eval: dict[str, Any] | None = None
        self.peft_model: Any = None
        self.locality: dict[str, Any] | None = None  # the adapter's locality figures and guard verdict
        self.held_back: dict[str, Any] | None = None  # the guard's reason when it held back an asked-for activation
        self.config_update: dict[str, Any] = {}  # set by measure_locality: an "auto" scope resolved to "corrections"
        self._t = time.perf_counter()

    def run(self) -> dict[str, Any]:
        resume = self.load_resume()
        self.setup()
        try:
            report = self.train(resume)
            self.locality = self.measure_locality(report)
            staging = self.save()
        finally:
            self.ctx.engine.delete_private_adapter(self.private)
        record = self.publish(staging)
        self.activate(record)
        return self.result(record, report, resume)

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self._t, 4)
        self._t = now

    # -------------------------------------------------------------- phases
    def load_resume(self) -> Checkpoint | None:
        if self.ctx.resume_checkpoints is None:
            return None
        return latest_checkpoint(self.ctx.resume_checkpoints, plan_sha256=self.plan.plan_sha256)

    def setup(self) -> None:
        """Add the private adapter (seeded, or the base adapter's weights) to the served model."""
        from safetensors.torch import load_file

        init = None
        if self.plan.parent is not None:
            init = load_file(str(Path(self.plan.parent.path) / WEIGHTS_FILE))
        lora = self.plan.lora
        config = lora_config(lora.rank, lora.alpha, lora.target_modules)
        self.peft_model = self.ctx.engine.peft_model()  # takes ownership itself: ask before exclusive()
        with self.ctx.engine.ownership.exclusive():
            add_private_adapter(self.peft_model, self.private, config, seed=self.plan.loop.seed, init_state=init)
        self._phase("prepare")

    def train(self, resume: Checkpoint | None) -> Report:
        raise NotImplementedError

    def measure_locality(self, report: Report) -> dict[str, Any]:
        """The adapter's locality (:func:`kiln.training.core.locality.job_locality`) as it will be served, with the
        locality guard's verdict (:func:`kiln.adapters.locality_guard.guard_verdict`); a job whose scope is
        ``"auto"`` and whose unscoped figures the guard refuses is published scoped to its corrections when that
        passes (:func:`kiln.adapters.scope.auto_scope`; :attr:`config_update`). A measure that fails leaves
        ``error`` instead of figures (the guard then holds the adapter back)."""
        from kiln.adapters.locality_guard import GuardPolicy, guard_verdict
        from kiln.adapters.scope import auto_scope
        from kiln.config import LocalitySettings
        from kiln.training.core.locality import job_locality

        section = self.ctx.locality if self.ctx.locality is not None else LocalitySettings()
        request = self.plan.request.get("locality") or {}
        policy = GuardPolicy.from_settings(section)

        def measure(scope: Any) -> dict[str, Any] | None:  # scoped: the base answers out of scope, as served
            try:
                return job_locality(self.peft_model, self.private, self.ctx.model, self.ctx.engine, section, request,
                                    self.ctx.hooks.exclusive, self.ctx.suites, scope)
            except Exception as exc:  # noqa: BLE001 - recorded; the guard holds the adapter back
                log.exception("locality measure of job %s failed", self.job_id)
                return {"error": f"the locality measure failed: {type(exc).__name__}: {exc}"}

        figures, verdict, self.config_update = auto_scope(
            self.plan.request, measure, lambda f: guard_verdict(f, policy, override=bool(request.get("override"))),
            learned=report.extra.get("learned") is True)  # the learned check passed on every example
        self._phase("locality")
        return {**(figures if figures is not None else {"measured": False}), "guard": verdict}

    def anchor(self, own: Sequence[Sequence[int]]) -> Any:
        """The job's KL-to-base anchor (:mod:`kiln.training.core.anchor`), less the rows whose prompt starts one of
        ``own`` (the job's sequences); None when the request turns it off. The rows are built once per base
        model and process, under exclusive ownership (the base model answers with every adapter disabled)."""
        from kiln.training.core.anchor import anchor_settings, model_anchor

        settings = anchor_settings(self.plan.request)
        if not settings.on:
            return None
        with self.ctx.engine.ownership.exclusive():
            anchor = model_anchor(self.peft_model, self.ctx.model, settings)
        self._phase("anchor")
        return anchor.without(own)

    def save(self) -> Staging:
        """Write standard PEFT files into a fresh staging dir of the adapter store."""
        staging = self.ctx.store.new_staging()
        try:
            save_adapter_files(self.peft_model, self.private, staging.path,
                               base_model_dir=str(self.ctx.model.path))
        except BaseException:
            staging.discard()
            raise
        return staging

    def publish(self, staging: Staging) -> AdapterRecord:
        """Publish the revision with its training receipt (:mod:`kiln.adapters.receipt`)."""
        plan = self.plan
        claims = training_claims(job_id=self.job_id, plan_sha256=plan.plan_sha256, inputs=receipt_inputs(plan),
                                 teacher=self.receipt_teacher(), locality=self.locality)
        record = self.ctx.store.publish(
            staging, name=plan.adapter, base_model_sha256=self.ctx.model.base_model_sha256, kind=plan.kind,
            config=plan.manifest_config | self.config_update | {"job_id": self.job_id} | self._base_representation(),
            inputs_sha256=plan.inputs_sha256,
            parent_revision=None if plan.parent is None else plan.parent.revision, base_model_dir=self.ctx.model.info,
            receipt=claims,
        )
        self._phase("publish")
        return record

    def _base_representation(self) -> dict[str, str]:
        """A quantized base (model.quantize) is recorded in the manifest: the LoRA was trained over it."""
        report = getattr(self.ctx.model, "quantization", None)
        return {} if report is None else {"base_representation": report.effective}

    def receipt_teacher(self) -> dict[str, Any] | None:
        """The teacher this job learned from, for its receipt (None: no teacher; OPD and KD say)."""
        return None

    def activate(self, record: AdapterRecord) -> None:
        """``auto_load``, or with ``post_eval`` only a ``promoted`` verdict with ``activate_on_pass``; through the
        activation service, so a refused activation (quarantine, memory, canary) or the locality guard holds the
        adapter back (:attr:`held_back`) and the job still succeeds: its revision is published."""
        post_eval = self.plan.request.get("post_eval")
        activate = self.plan.auto_load
        if post_eval is not None:
            self.post_eval = (self.ctx.gate(record, post_eval) if self.ctx.gate is not None
                              else {"verdict": "error", "reason": "evals are not available in this process"})
            self._phase("post_eval")
            self.ctx.store.record_gate(record.name, record.revision, self.post_eval)  # into the receipt
            activate = self.post_eval.get("verdict") == "promoted" and bool(post_eval.get("activate_on_pass"))
        if activate and not self.admitted_by_guard():
            activate = False
        if activate:
            activate = self._activate(record)
        if activate and post_eval is not None and post_eval.get("set_default_on_pass") \
                and self.ctx.set_default is not None:
            self.ctx.set_default(record.name, record.revision)
            self.default_set = True
        self.activated = activate
        self._phase("activate")

    def _activate(self, record: AdapterRecord) -> bool:
        """Serve ``record`` through the activation service; a refusal is recorded in :attr:`held_back`."""
        from kiln.adapters.activation import AdapterActivation
        from kiln.errors import KilnError

        service = self.ctx.activation or AdapterActivation(self.ctx.engine, self.ctx.store,
                                                           self.ctx.model.base_model_sha256)
        try:  # this job's own training reservation ends with it: it is not in the adapter's way
            service.activate(record, ignore_kinds=frozenset({"training"}))
        except KilnError as exc:
            log.warning("job %s: adapter %s@%s held back: %s", self.job_id, record.name, record.revision[:12],
                        exc.message)
            self.held_back = {"code": exc.code, "reason": exc.message}
            return False
        return True

    def admitted_by_guard(self) -> bool:
        """Whether the locality guard lets this job activate its adapter (auto_load, post_eval activate_on_pass
        and set_default_on_pass); when it does not, :attr:`held_back` names why."""
        verdict = (self.locality or {}).get("guard")
        if verdict is None or verdict["admitted"] or not verdict["enabled"]:
            return True
        self.held_back = {"code": verdict["code"], "reason": verdict["reason"]}
        return False

    def result(self, record: AdapterRecord, report: Report, resume: Checkpoint | None) -> dict[str, Any]:
        return {
            "adapter": record.name,
            "revision": record.revision,
            "path": str(record.path),
            "activated": self.activated,
            **({"default_adapter": True} if self.default_set else {}),
            "resumed_from_step": None if resume is None else resume.step,
            "report": report.as_dict(),
            **({"post_eval": self.post_eval} if self.post_eval is not None else {}),
            "locality": self.locality,
            **({"held_back": self.held_back} if self.held_back is not None else {}),
            "timings_s": self.timings | {"total": round(sum(self.timings.values()), 4)},
        }


def step_plan(plan: JobPlan[Any], *, compile: bool = False) -> Plan:
    """The loop plan with the request's step options: ``packing`` and ``gradient_checkpointing`` (request
    fields, so in the plan digest) and ``compile`` (the server's ``training.compile``). A request without
    them (GRPO, OPD, KD, or one stored before they existed) computes its steps as before."""
    req = plan.request
    return replace(plan.loop, packing=bool(req.get("packing", False)),
                   gradient_checkpointing=bool(req.get("gradient_checkpointing", False)),
                   compile=compile and plan.kind == "sft")  # only run_sft compiles its trunk


def receipt_inputs(plan: JobPlan[Any]) -> dict[str, Any]:
    """The inputs' digests a receipt records: the job's inputs digest and every file digest its effective
    request holds (``dataset_sha256``, ``teacher_jsonl_sha256``, ``capture_plan_sha256``)."""
    files = {k: v for k, v in plan.request.items()
             if k.endswith("_sha256") and k not in ("inputs_sha256", "plan_sha256") and isinstance(v, str)}
    return {"inputs_sha256": plan.inputs_sha256, **files}


def published_result(record: AdapterRecord) -> dict[str, Any]:
    """The result of a job found published after a restart (it died between publication and its record)."""
    return {
        "adapter": record.name,
        "revision": record.revision,
        "path": str(record.path),
        "activated": False,
        "resumed_from_step": None,
        "report": None,
        "reconciled": "published before the server stopped; found in the adapter store at restart",
    }
