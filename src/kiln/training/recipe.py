"""One training job as a recipe: a typed plan in, then setup -> train -> save -> publish -> activate.

:class:`JobPlan` is everything a job needs, validated once at submission
(:meth:`kiln.training.service.TrainingService.prepare`). :class:`TrainingRecipe`
runs it on the served model, in the spirit of torchtune's single-device
recipes: each phase is one method, called in order by :meth:`TrainingRecipe.run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from kiln.adapters.validate import CONFIG_FILE, WEIGHTS_FILE
from kiln.training.checkpoints import Checkpoint, latest_checkpoint
from kiln.training.data import Row
from kiln.training.trainer import (
    GRPOItem,
    GRPOSettings,
    Hooks,
    Plan,
    Report,
    add_private_adapter,
    lora_config,
    run_grpo,
    run_sft,
    save_adapter_files,
)

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord, AdapterStore, Staging
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel

# Request fields that describe how a job is run, not what it computes (left out of the plan digest).
RUN_ONLY_FIELDS = ("resume_from_job", "auto_load", "checkpoint_interval")
# Fields left out of the adapter manifest's config (bulky inputs and digests recorded elsewhere).
NOT_IN_MANIFEST = ("examples", "groups", "prompts", "inputs_sha256", "plan_sha256", "resume_from_job")


@dataclass(frozen=True)
class LoraShape:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class GRPOData:
    items: tuple[GRPOItem, ...]
    skipped: int  # zero-variance groups dropped at submission
    settings: GRPOSettings


@dataclass(frozen=True)
class JobPlan:
    """A fully validated job: what to train on, how, and where the result goes."""

    kind: Literal["sft", "grpo", "opd", "kd"]
    adapter: str
    request: dict[str, Any]  # the effective request (defaults resolved), as stored in the queue
    inputs_sha256: str
    plan_sha256: str
    lora: LoraShape
    loop: Plan
    rows: tuple[Row, ...] | GRPOData  # SFT rows, or GRPO groups with advantages
    parent: AdapterRecord | None  # base_adapter's record
    auto_load: bool
    resume_from_job: str | None

    @property
    def manifest_config(self) -> dict[str, Any]:
        return {k: v for k, v in self.request.items() if k not in NOT_IN_MANIFEST}


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


class TrainingRecipe:
    """Runs one :class:`JobPlan` on the engine's model; :meth:`run` reads top to bottom."""

    def __init__(self, plan: JobPlan, ctx: RecipeContext, *, job_id: str):
        self.plan, self.ctx, self.job_id = plan, ctx, job_id
        self.private = f"kiln-{job_id}"
        self.timings: dict[str, float] = {}
        self.activated = False
        self.post_eval: dict[str, Any] | None = None
        self.peft_model: Any = None
        self._t = time.perf_counter()

    def run(self) -> dict[str, Any]:
        resume = self.load_resume()
        self.setup()
        try:
            report = self.train(resume)
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
        peft_model = self.peft_model
        pad_id = self.ctx.model.tokenizer.pad_token_id
        rows, loop, hooks = self.plan.rows, step_plan(self.plan, compile=self.ctx.compile), self.ctx.hooks
        if isinstance(rows, GRPOData):
            report = run_grpo(peft_model, self.private, rows.items, loop, rows.settings, pad_id=pad_id,
                              skipped_groups=rows.skipped, hooks=hooks, resume=resume)
        else:
            report = run_sft(peft_model, self.private, rows, loop, pad_id=pad_id, hooks=hooks, resume=resume)
        self._phase("train")
        return report

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
        plan = self.plan
        record = self.ctx.store.publish(
            staging, name=plan.adapter, base_model_sha256=self.ctx.model.base_model_sha256, kind=plan.kind,
            config=plan.manifest_config | {"job_id": self.job_id}, inputs_sha256=plan.inputs_sha256,
            parent_revision=None if plan.parent is None else plan.parent.revision, base_model_dir=self.ctx.model.info,
        )
        self._phase("publish")
        return record

    def activate(self, record: AdapterRecord) -> None:
        """``auto_load``, or with ``post_eval`` only a ``promoted`` verdict with ``activate_on_pass``."""
        post_eval = self.plan.request.get("post_eval")
        activate = self.plan.auto_load
        if post_eval is not None:
            self.post_eval = (self.ctx.gate(record, post_eval) if self.ctx.gate is not None
                              else {"verdict": "error", "reason": "evals are not available in this process"})
            self._phase("post_eval")
            activate = self.post_eval.get("verdict") == "promoted" and bool(post_eval.get("activate_on_pass"))
        if activate:
            self.ctx.engine.activate_adapter(record.name, Path(record.path), record.revision)
        self.activated = activate
        self._phase("activate")

    def result(self, record: AdapterRecord, report: Report, resume: Checkpoint | None) -> dict[str, Any]:
        return {
            "adapter": record.name,
            "revision": record.revision,
            "path": str(record.path),
            "activated": self.activated,
            "resumed_from_step": None if resume is None else resume.step,
            "report": report.as_dict(),
            **({"post_eval": self.post_eval} if self.post_eval is not None else {}),
            "timings_s": self.timings | {"total": round(sum(self.timings.values()), 4)},
        }


def step_plan(plan: JobPlan, *, compile: bool = False) -> Plan:
    """The loop plan with the request's step options: ``packing`` and ``gradient_checkpointing`` (request
    fields, so in the plan digest) and ``compile`` (the server's ``training.compile``). A request without
    them (GRPO, OPD, KD, or one stored before they existed) computes its steps as before."""
    req = plan.request
    return replace(plan.loop, packing=bool(req.get("packing", False)),
                   gradient_checkpointing=bool(req.get("gradient_checkpointing", False)),
                   compile=compile and plan.kind == "sft")  # only run_sft compiles its trunk


def seal_plan(kind: str, eff: dict[str, Any], inputs: Any, base_model_sha256: str) -> tuple[str, str]:
    """Digest a job's inputs and plan (kind, effective request less ``RUN_ONLY_FIELDS``, inputs, base model),
    record both in ``eff`` and return ``(inputs_sha256, plan_sha256)``."""
    from kiln.canonical import canonical_json_bytes, domain_digest

    inputs_sha = domain_digest("kiln.training-inputs.v1", kind.encode(), canonical_json_bytes(inputs))
    plan_fields = {k: v for k, v in eff.items() if k not in RUN_ONLY_FIELDS}
    plan_sha = domain_digest("kiln.training-plan.v1", canonical_json_bytes(
        {"kind": kind, "config": plan_fields, "inputs_sha256": inputs_sha, "base_model_sha256": base_model_sha256}))
    eff["inputs_sha256"], eff["plan_sha256"] = inputs_sha, plan_sha
    return inputs_sha, plan_sha


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


def lora_shape_of(adapter_dir: Path) -> LoraShape:
    import json

    cfg = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text("utf-8"))
    return LoraShape(int(cfg["r"]), float(cfg["lora_alpha"]), tuple(sorted(cfg["target_modules"])))
