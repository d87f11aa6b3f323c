"""A training job's typed plan, the one function that seals its digests, and what ``prepare`` checks against.

Every job kind (:mod:`kiln.training.queue.kinds`) turns its request into a :class:`JobPlan` whose
``data`` is that kind's own payload (:class:`~kiln.training.sft.job.SFTData`,
:class:`~kiln.training.grpo.job.GRPOData`,
:class:`~kiln.training.grpo.rollouts.RolloutData`, :class:`~kiln.training.opd.job.OPDData`,
:class:`~kiln.training.kd.job.KDData`). Its inputs and plan digests are made by :func:`seal_plan`
alone (docs/training.md, "Digests"). A kind's ``prepare`` gets a :class:`PrepareContext`: the served
model, the adapter store, the settings and the queue, built by the training service (or by
``kiln train run`` without a server).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar

from kiln.adapters.validate import CONFIG_FILE
from kiln.canonical import canonical_json_bytes, domain_digest
from kiln.errors import Conflict, InvalidRequest, NotFound
from kiln.training.schemas import (
    DEFAULT_ANCHOR_PER_STEP,
    DEFAULT_ANCHOR_QUESTIONS,
    DEFAULT_ANCHOR_WEIGHT,
    DEFAULT_LORA_RANK,
    DEFAULT_TARGET_MODULES,
    MLP_TARGET_MODULES,
    LINEAR_ATTENTION_TARGET_MODULES,
)

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord, AdapterStore
    from kiln.config import Settings
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel
    from kiln.teachers.service import TeacherService
    from kiln.training.core.loop import Plan

# Hash domains of the two job digests (normative: docs/training.md, "Digests").
INPUTS_DOMAIN = "kiln.training-inputs.v1"
PLAN_DOMAIN = "kiln.training-plan.v1"
# Request fields that describe how a job is run, not what it computes (left out of the plan digest).
RUN_ONLY_FIELDS = ("resume_from_job", "auto_load", "checkpoint_interval", "locality")
# Fields left out of the adapter manifest's config (bulky inputs and digests recorded elsewhere).
NOT_IN_MANIFEST = ("examples", "groups", "prompts", "inputs_sha256", "plan_sha256", "resume_from_job", "locality")

D = TypeVar("D")


@dataclass(frozen=True)
class LoraShape:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class JobPlan(Generic[D]):
    """A fully validated job: what to train on (``data``, the kind's own payload), how, and where it goes."""

    kind: str  # the queue's and the manifest's kind: sft | grpo | opd | kd
    adapter: str
    request: dict[str, Any]  # the effective request (defaults resolved), as stored in the queue
    inputs_sha256: str
    plan_sha256: str
    lora: LoraShape
    loop: Plan
    data: D
    parent: AdapterRecord | None  # base_adapter's record
    auto_load: bool
    resume_from_job: str | None

    @property
    def manifest_config(self) -> dict[str, Any]:
        return {k: v for k, v in self.request.items() if k not in NOT_IN_MANIFEST}


def seal_plan(kind: str, eff: dict[str, Any], inputs: Any, base_model_sha256: str, *,
              domains: tuple[str, str] = (INPUTS_DOMAIN, PLAN_DOMAIN)) -> tuple[str, str]:
    """Digest a job's inputs and plan, record both in ``eff`` and return ``(inputs_sha256, plan_sha256)``.

    ``inputs_sha256 = H(inputs domain, kind, canonical_json(inputs))``; ``plan_sha256 = H(plan domain,
    canonical_json({kind, config: eff less RUN_ONLY_FIELDS, inputs_sha256, base_model_sha256}))``. The only
    place a job digest is made; every kind passes its own ``inputs`` (and could pass its own ``domains``)."""
    inputs_domain, plan_domain = domains
    inputs_sha = domain_digest(inputs_domain, kind.encode(), canonical_json_bytes(inputs))
    plan_fields = {k: v for k, v in eff.items() if k not in RUN_ONLY_FIELDS}
    plan_sha = domain_digest(plan_domain, canonical_json_bytes(
        {"kind": kind, "config": plan_fields, "inputs_sha256": inputs_sha, "base_model_sha256": base_model_sha256}))
    eff["inputs_sha256"], eff["plan_sha256"] = inputs_sha, plan_sha
    return inputs_sha, plan_sha


class JobQueue(Protocol):
    """What a kind's ``prepare`` reads of the queue (:class:`kiln.training.queue.jobs.JobStore`)."""

    def get(self, job_id: str) -> Any: ...

    def active(self) -> list[Any]: ...


class ResumeCheck(Protocol):
    def __call__(self, job_id: str, plan_sha: str, eff: dict[str, Any] | None = None) -> None: ...


def checkpoint_root(training_root: Path, job_id: str) -> Path:
    """Where a queued job's checkpoints live: ``<home>/training/jobs/<job>/checkpoints``."""
    return training_root / "jobs" / job_id / "checkpoints"


class _LoraRequest(Protocol):
    adapter: str
    base_adapter: str | None
    lora_rank: int | None
    lora_alpha: float | None
    lora_target_modules: list[str] | None


@dataclass(frozen=True)
class PrepareContext:
    """What a job kind's ``prepare(context, request)`` checks a request against.

    Built by :meth:`kiln.training.queue.service.TrainingService.context` (``engine``, ``teachers`` and ``jobs``
    set) or by ``kiln train run`` (no server: ``engine``, ``teachers`` and ``jobs`` are None, SFT only).
    """

    model: LoadedModel
    store: AdapterStore
    settings: Settings
    root: Path  # <home>/training
    linear_names: frozenset[str]  # the model's linear module suffixes (LoRA targets)
    end_ids: frozenset[int]  # token IDs that end an assistant turn
    check_resumable: ResumeCheck  # resume_from_job against the queue (or a distributed job directory)
    engine: Engine | None = None  # the serving engine: sampling kinds (rollouts, OPD) need it
    teachers: TeacherService | None = None  # OPD's teacher registry
    jobs: JobQueue | None = None  # the queue (KD checks jobs consuming the same capture)

    @property
    def max_seq_len_limit(self) -> int | None:
        """The longest sequence the model supports (``max_position_embeddings``), if it says."""
        return getattr(self.model, "max_model_len", None)

    def serving_engine(self, kind: str) -> Engine:
        if self.engine is None:
            raise Conflict(f"{kind} jobs sample on the serving engine; run them on `kiln serve`",
                           code="training_kind_unsupported")
        return self.engine

    def checkpoint_root(self, job_id: str) -> Path:
        return checkpoint_root(self.root, job_id)

    def check_adapter_name(self, name: str) -> None:
        if name == self.model.model_id:
            raise InvalidRequest(f"{name!r} is the base model's ID", code="invalid_adapter_name",
                                 hint="choose another adapter name")

    def lookup_adapter(self, name: str) -> AdapterRecord:
        """``base_adapter``'s record: 404 when it is not in the store, 409 when trained on another base model."""
        from kiln.adapters.errors import AdapterNotFound

        try:
            record = self.store.get(name)
        except AdapterNotFound:
            raise NotFound(f"base_adapter {name!r} is not in the adapter store", code="adapter_not_found",
                           hint="list adapters with GET /v1/adapters") from None
        base = record.manifest.base_model_sha256
        if base != self.model.base_model_sha256:
            raise Conflict(f"adapter {name!r} was trained on another base model ({base})",
                           code="adapter_base_mismatch", hint="continue from an adapter of the served model")
        return record

    def parent_of(self, request: _LoraRequest) -> AdapterRecord | None:
        return None if request.base_adapter is None else self.lookup_adapter(request.base_adapter)

    def lora_shape(self, request: _LoraRequest, parent: AdapterRecord | None, *,
                   default_targets: Callable[[frozenset[str]], list[str]] | None = None) -> LoraShape:
        """The parent's LoRA shape (the request may only repeat it), else the request's or the defaults
        (``default_targets``: the kind's default target modules for this model's linear names; none: the
        attention default, :func:`default_target_modules`)."""
        if parent is not None:
            shape = lora_shape_of(parent.path)
            asked = (request.lora_rank, request.lora_alpha, request.lora_target_modules)
            have = (shape.rank, shape.alpha, list(shape.target_modules))
            for given, had, label in zip(asked, have, ("lora_rank", "lora_alpha", "lora_target_modules")):
                if given is not None and given != had:
                    raise InvalidRequest(f"{label}={given!r} differs from base_adapter {parent.name!r} ({had!r})",
                                         code="lora_config_conflict",
                                         hint="omit the LoRA fields when continuing from a base adapter")
            return shape
        rank = request.lora_rank or DEFAULT_LORA_RANK
        alpha = float(request.lora_alpha if request.lora_alpha is not None else 2 * rank)
        targets = request.lora_target_modules or (default_targets or default_target_modules)(self.linear_names)
        missing = [t for t in targets if t not in self.linear_names]
        if missing:
            raise InvalidRequest(f"the model has no linear modules named {missing}", code="unknown_target_modules",
                                 hint=f"choose among {sorted(self.linear_names)}")
        return LoraShape(rank, alpha, tuple(targets))


def lora_fields(lora: LoraShape, parent: AdapterRecord | None) -> dict[str, Any]:
    """The effective request's LoRA and base-adapter fields (every kind records them in its plan)."""
    return {"lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_target_modules": list(lora.target_modules),
            "base_adapter_revision": None if parent is None else parent.revision}


def anchor_fields(request: Any, *, default_weight: float = DEFAULT_ANCHOR_WEIGHT) -> dict[str, Any]:
    """The effective request's KL-to-base anchor fields (docs/training.md, "Locality"): the request's, else the
    defaults; a zero weight or zero questions turn it off (recorded as weight 0). Every kind records them."""
    weight = request.anchor_weight if request.anchor_weight is not None else default_weight
    questions = request.anchor_questions if request.anchor_questions is not None else DEFAULT_ANCHOR_QUESTIONS
    per_step = request.anchor_per_step if request.anchor_per_step is not None else DEFAULT_ANCHOR_PER_STEP
    if not weight or not (questions or getattr(request, "anchor_prompts", None)):
        weight, questions = 0.0, 0
    return {"anchor_weight": float(weight), "anchor_questions": int(questions), "anchor_per_step": int(per_step)}


def decay_fields(request: Any, *, default: float = 0.0) -> dict[str, Any]:
    """The effective request's AdamW ``weight_decay``: the request's, else the kind's default (SFT's
    DEFAULT_SFT_WEIGHT_DECAY, 0 for the others; docs/training.md, "Locality")."""
    decay = request.weight_decay if request.weight_decay is not None else default
    return {"weight_decay": float(decay)}


def default_target_modules(linear_names: set[str] | frozenset[str]) -> list[str]:
    """The attention projections, plus the Gated DeltaNet ones when the model has those layers."""
    targets = set(DEFAULT_TARGET_MODULES)
    if _hybrid(linear_names):
        targets |= {m for m in LINEAR_ATTENTION_TARGET_MODULES if m in linear_names}
    return sorted(targets)


def _hybrid(linear_names: set[str] | frozenset[str]) -> bool:
    """Whether the model has a Qwen3.5 hybrid's linear-attention (Gated DeltaNet) layers."""
    return {"in_proj_qkv", "in_proj_z"} <= linear_names


def correction_target_modules(linear_names: frozenset[str]) -> list[str]:
    """SFT's default targets: the MLP projections (gate, up, down) when the model has all three and no
    linear-attention layers, else the attention default (a Qwen3.5 hybrid keeps its every-projection default: not
    measured for locality). Issue 48, the knowledge world (bench/locality.py world, 200 facts): ten sequential
    corrections with the anchor at lr 2e-3 kept 97% of the other facts through MLP-only LoRA against 88% through
    q/k/v/o, every paraphrase against 70%, in 190 steps against 296 (docs/training.md, "Locality")."""
    if set(MLP_TARGET_MODULES) <= linear_names and not _hybrid(linear_names):
        return sorted(MLP_TARGET_MODULES)
    return default_target_modules(linear_names)


def linear_module_suffixes(model: Any) -> frozenset[str]:
    """The last name of every ``nn.Linear`` in ``model`` (PEFT wrappers and ``lm_head`` left out)."""
    import torch

    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lora_" not in name:
            parts = name.split(".")
            if parts[-1] == "base_layer":  # already wrapped by PEFT
                parts = parts[:-1]
            names.add(parts[-1])
    return frozenset(names - {"lm_head"})


def lora_shape_of(adapter_dir: Path) -> LoraShape:
    cfg = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text("utf-8"))
    return LoraShape(int(cfg["r"]), float(cfg["lora_alpha"]), tuple(sorted(cfg["target_modules"])))


def prepare_context(*, model: LoadedModel, store: AdapterStore, settings: Settings,
                    check_resumable: ResumeCheck, **services: Any) -> PrepareContext:
    """A context over ``model`` (its LoRA targets and end-of-turn IDs read once here)."""
    from kiln.training.core.templates import end_of_turn_ids

    return PrepareContext(model, store, settings, settings.home_path / "training",
                          linear_module_suffixes(model.model),
                          end_of_turn_ids(model.tokenizer, getattr(model.model, "generation_config", None)),
                          check_resumable, **services)

