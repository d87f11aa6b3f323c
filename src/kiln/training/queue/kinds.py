"""The job-kind registry: the one list of training job kinds.

Each :class:`JobKind` names its wire schema (the body of ``POST /v1/train/<kind>``), its
``prepare(context, request) -> JobPlan[data]`` (every check that can run before queueing, then
the sealed plan) and its recipe class (what the worker runs). The training service prepares,
rebuilds after a restart and executes through this table, and the HTTP routes are made from it
(:mod:`kiln.serving.routes_training`): adding a kind is one entry here.

Two kinds can share a wire kind (``grpo``: pre-scored groups, or ``prompts`` Kiln samples and
scores itself); ``applies`` picks between them, and a plan's ``data`` type names its kind again
when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from pydantic import BaseModel

from kiln.training.core.plan import JobPlan, PrepareContext
from kiln.training.core.recipe import TrainingRecipe
from kiln.training.grpo.job import GRPOData, GRPORecipe, prepare_grpo
from kiln.training.grpo.rollouts import RolloutData, RolloutRecipe, prepare_rollouts
from kiln.training.kd.job import KDData, KDRecipe, prepare_kd
from kiln.training.kd.schemas import KDRequest
from kiln.training.opd.job import OPDData, OPDRecipe, prepare_opd
from kiln.training.opd.schemas import OPDRequest
from kiln.training.schemas import GRPORequest, SFTRequest
from kiln.training.sft.job import SFTData, SFTRecipe, prepare_sft

R = TypeVar("R", bound=BaseModel)
D = TypeVar("D")


def _always(request: Any) -> bool:
    return True


@dataclass(frozen=True)
class JobKind(Generic[R, D]):
    name: str  # the registry's key
    kind: str  # the queue's and the adapter manifest's kind; the route is POST /v1/train/<kind>
    schema: type[R]  # the request body
    data: type[D]  # the plan payload this kind's prepare makes and its recipe runs
    prepare: Callable[[PrepareContext, R], JobPlan[D]]
    recipe: type[TrainingRecipe]
    summary: str  # the route's description (the first kind of a wire kind gives it)
    applies: Callable[[R], bool] = _always  # which requests of ``schema`` this kind takes


KINDS: tuple[JobKind[Any, Any], ...] = (
    JobKind("sft", "sft", SFTRequest, SFTData, prepare_sft, SFTRecipe,
            "Queue a LoRA SFT job (loss on assistant tokens only)."),
    JobKind("grpo", "grpo", GRPORequest, GRPOData, prepare_grpo, GRPORecipe,
            "Queue a GRPO job: over pre-scored completion groups, or over `prompts` that Kiln samples `group_size` "
            "completions for and scores with `reward` (an eval scorer, a sandboxed Python file under the data dir, "
            "or an HTTP endpoint on loopback), `iterations` times (docs/training.md, \"GRPO with rollouts\"). Every "
            "check runs before queueing: 400 (invalid request, unknown scorer, missing reference, non-loopback URL, "
            "reward file outside the data dir, code execution disabled), 404 (base adapter or reward file not found), "
            "409 (base adapter of another model), 503 (queue full, training disabled).",
            applies=lambda r: r.prompts is None),
    JobKind("grpo_rollouts", "grpo", GRPORequest, RolloutData, prepare_rollouts, RolloutRecipe, "",
            applies=lambda r: r.prompts is not None),
    JobKind("opd", "opd", OPDRequest, OPDData, prepare_opd, OPDRecipe,
            "Queue an on-policy distillation job: the student samples, a registered teacher scores, the student "
            "moves toward the teacher on its own tokens (docs/training.md, \"On-policy distillation\")."),
    JobKind("kd", "kd", KDRequest, KDData, prepare_kd, KDRecipe,
            "Queue a sparse-KD job on the served model's adapter from an offline capture run under the data dir, "
            "consumed through its ledger exactly once (docs/training.md, \"Sparse KD from a capture\")."),
)


def kind_of(request: BaseModel) -> JobKind[Any, Any]:
    """The kind that takes ``request``."""
    for k in KINDS:
        if isinstance(request, k.schema) and k.applies(request):
            return k
    raise TypeError(f"no training job kind takes a {type(request).__name__}")


def kind_of_plan(plan: JobPlan[Any]) -> JobKind[Any, Any]:
    """The kind whose prepare made ``plan`` (by its payload type)."""
    for k in KINDS:
        if isinstance(plan.data, k.data):
            return k
    raise TypeError(f"no training job kind runs a {type(plan.data).__name__} plan")


def schema_for(kind: str) -> type[BaseModel]:
    """The wire schema of a stored job's ``kind`` (a job rebuilt from the queue after a restart)."""
    for k in KINDS:
        if k.kind == kind:
            return k.schema
    raise KeyError(kind)


def wire_kinds() -> list[JobKind[Any, Any]]:
    """One kind per ``POST /v1/train/<kind>`` route (the first registered for each wire kind)."""
    seen: dict[str, JobKind[Any, Any]] = {}
    for k in KINDS:
        seen.setdefault(k.kind, k)
    return list(seen.values())


def prepare(ctx: PrepareContext, request: BaseModel) -> JobPlan[Any]:
    """Validate everything that can be checked before the job runs; return the job's typed plan."""
    return kind_of(request).prepare(ctx, request)
