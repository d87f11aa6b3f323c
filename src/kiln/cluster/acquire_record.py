"""What an acquisition is asked and what it recorded: the world plan, the parallel-group layout,
the acquisition record, and the errors of :mod:`kiln.cluster.acquire`.

Pure data and checks (pydantic and the standard library); the acquisition itself, which spawns
the gloo world and mints outcomes and receipts, is :mod:`kiln.cluster.acquire`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from kiln.system.ranks import MAX_IDENTIFIER_CHARS, MAX_WORLD_SIZE, DeclaredObservation, canonical_host


ACQUISITION_METHOD = "multiprocessing.spawn+gloo"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_TIMEOUT_S = 60.0
"""Seconds the rendezvous and each collective may wait for missing peers."""
MAX_TIMEOUT_S = 3600.0
MAX_NPROC_PER_HOST = 256
MAX_NNODES = 4096
MAX_REPORT_BYTES = 64 << 20
"""Largest gathered report file the collector reads back, in bytes."""
MAX_PID = (1 << 31) - 1
MAX_TORCH_VERSION_CHARS = 64
INCARNATION_TOKEN_BYTES = 16
COLLECTIVES_PER_WORLD = 3
"""Rendezvous, group creation, gather: each may wait ``timeout_s``."""
SUPERVISION_SLACK_S = 60.0
"""Extra seconds the supervisor allows for interpreter and torch start-up."""
MAX_ERROR_CHARS = 2000


class AcquisitionError(RuntimeError):
    """The world could not be formed, did not report back, or reported an unusable layout."""


class AcquisitionConfigError(ValueError):
    """The requested world is not a valid plan (bad sizes, ranks or hosts)."""


class AcquisitionRecordError(ValueError):
    """An acquisition record is not consistent in itself (bounds, sizes, process groups)."""


class EvidenceError(ValueError):
    """A serialised outcome does not hold together (shape, record vs observation, decision)."""


class NotCoherentError(ValueError):
    """A receipt was requested for a population the law refused."""


class ReceiptForgeryError(TypeError):
    """An outcome or receipt was constructed or deserialised instead of acquired."""


# ------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class WorldPlan:
    """What to start on *this* host; every host of the world runs one plan."""

    nproc_per_host: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    """0 picks a free port; only allowed for a single-host world."""
    selected_hosts: tuple[str, ...] = ()
    """The hosts the deployment meant to use; empty means this host alone (nnodes == 1 only)."""
    incarnation: Optional[str] = None
    """The run this host's ranks are launched into (torchrun's rendezvous ID plays this part).
    None draws a random one, which only a single-host world may do."""
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 1 <= self.nproc_per_host <= MAX_NPROC_PER_HOST:
            raise AcquisitionConfigError(
                f"nproc_per_host={self.nproc_per_host} must be between 1 and {MAX_NPROC_PER_HOST}"
            )
        if not 1 <= self.nnodes <= MAX_NNODES:
            raise AcquisitionConfigError(f"nnodes={self.nnodes} must be between 1 and {MAX_NNODES}")
        if not 0 <= self.node_rank < self.nnodes:
            raise AcquisitionConfigError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if not 0 <= self.master_port <= 65535:
            raise AcquisitionConfigError(f"master_port={self.master_port} is not a TCP port")
        if self.master_port == 0 and self.nnodes > 1:
            raise AcquisitionConfigError(
                "a multi-host world needs an explicit master_port that every host agrees on"
            )
        if self.nnodes > 1 and self.node_rank == 0 and not self.selected_hosts:
            raise AcquisitionConfigError(
                "a multi-host world must name its selected hosts on node 0 (one --selected-host per host); "
                "the law checks the observed hosts against them"
            )
        if self.nnodes > 1 and self.incarnation is None:
            raise AcquisitionConfigError(
                "a multi-host world needs an explicit incarnation that every host agrees on (--incarnation); "
                "each host's ranks report the one they were launched into"
            )
        for what, value in [*(("selected host", h) for h in self.selected_hosts), ("incarnation", self.incarnation)]:
            if value is not None and not 1 <= len(value) <= MAX_IDENTIFIER_CHARS:
                raise AcquisitionConfigError(
                    f"{what} {value!r} must be 1 to {MAX_IDENTIFIER_CHARS} characters long"
                )
        for host in self.selected_hosts:
            try:
                canonical_host(host)
            except ValueError as exc:
                raise AcquisitionConfigError(f"selected host: {exc}") from None
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise AcquisitionConfigError(f"timeout_s={self.timeout_s} must be in (0, {MAX_TIMEOUT_S}]")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_host


# ---------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups one rank belongs to, as the caller's layout created them.

    ``data_parallel`` None means the layout created no data-parallel groups: the
    world declares DP = 1, and the law checks that TP x PP then covers it.
    ``incarnation`` None means the rank belongs to the incarnation its host was
    launched into; a layout names another where the rank knows it belongs to one
    (the engine ID of a vLLM worker, say).
    """

    tensor_parallel: Any
    pipeline_parallel: Any
    data_parallel: Any = None
    incarnation: Optional[str] = None


Layout = Callable[[int, int], ParallelGroups]
"""``layout(global_rank, world_size)``, run in every rank once the world has formed.

It must call ``torch.distributed.new_group`` identically on every rank (the call
is collective) and return the groups this rank belongs to. It travels to the
spawned ranks by pickling, so it must be a module-level function or a picklable
object such as :class:`GridLayout`.
"""


@dataclass(frozen=True)
class GridLayout:
    """vLLM's arrangement: TP groups of consecutive ranks, PP groups strided by the TP size.

    Rank ``r`` is TP rank ``r % tp`` of stage ``(r // tp) % pp``; no DP groups are
    created. The CLI uses it for ``--tensor-parallel-size/--pipeline-parallel-size``.
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name, size in (("tensor_parallel_size", self.tensor_parallel_size),
                           ("pipeline_parallel_size", self.pipeline_parallel_size)):
            if not 1 <= size <= MAX_WORLD_SIZE:
                raise AcquisitionConfigError(f"{name}={size} must be between 1 and {MAX_WORLD_SIZE}")

    def groups_for(self, world_size: int) -> tuple[list[list[int]], list[list[int]]]:
        """The TP groups and PP groups of a world of ``world_size`` ranks."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if world_size % (tp * pp):
            raise AcquisitionConfigError(
                f"a world of {world_size} ranks cannot be cut into groups of tensor_parallel_size={tp} "
                f"x pipeline_parallel_size={pp}: {tp * pp} does not divide {world_size}"
            )
        tp_groups = [list(range(first, first + tp)) for first in range(0, world_size, tp)]
        pp_groups = [
            [block + t + stage * tp for stage in range(pp)]
            for block in range(0, world_size, tp * pp)
            for t in range(tp)
        ]
        return tp_groups, pp_groups

    def __call__(self, rank: int, world_size: int) -> ParallelGroups:
        tp_groups, pp_groups = self.groups_for(world_size)
        return ParallelGroups(
            tensor_parallel=_new_groups_holding(rank, tp_groups),
            pipeline_parallel=_new_groups_holding(rank, pp_groups),
        )


def _new_groups_holding(rank: int, groups: list[list[int]]) -> Any:
    """Create every group (a collective call) and return the one holding ``rank``."""
    import torch.distributed as dist

    mine = None
    for ranks in groups:
        group = dist.new_group(ranks=ranks, backend="gloo")
        if rank in ranks:
            mine = group
    return mine


# ---------------------------------------------------------------------- record

# Scalars are strict ("29500" is not a port); tuples are lax so that JSON arrays stand for them.
_Identifier = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_IDENTIFIER_CHARS)]
_Host = Annotated[str, Strict(), AfterValidator(canonical_host)]
_Pid = Annotated[int, Strict(), Field(ge=1, le=MAX_PID)]
_Group = Annotated[
    tuple[Annotated[int, Strict(), Field(ge=0, lt=MAX_WORLD_SIZE)], ...], Field(max_length=MAX_WORLD_SIZE)
]
_Groups = Annotated[tuple[_Group, ...], Field(min_length=1, max_length=MAX_WORLD_SIZE)]


def problems_of(exc: ValidationError) -> str:
    def one(error: Any) -> str:
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        return f"{where}: {message}" if where else message

    return "; ".join(one(e) for e in exc.errors())


class AcquisitionRecord(BaseModel):
    """How, when and from where an observation was acquired, and the groups the ranks reported.

    Constructing one checks it is consistent in itself (bounds, ``nnodes x
    nproc_per_host == world_size``, a time order, and each family of groups
    partitioning the world into equal groups that meet every other family's
    groups in at most one rank) and raises :class:`AcquisitionRecordError`
    naming every problem. It does not check the decomposition against the world
    size: that is the law's finding to make.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["multiprocessing.spawn+gloo"]
    """How the world was started and which torch.distributed backend it used."""
    backend: Literal["gloo"]
    torch_version: Annotated[str, Strict(), Field(min_length=1, max_length=MAX_TORCH_VERSION_CHARS)]
    started_at: Annotated[str, Strict()]
    """UTC, ISO 8601, when the collector began starting its workers."""
    finished_at: Annotated[str, Strict()]
    """UTC, ISO 8601, when the gathered reports were back with the collector."""
    master_addr: _Identifier
    master_port: Annotated[int, Strict(), Field(ge=1, le=65535)]
    world_size: Annotated[int, Strict(), Field(ge=1, le=MAX_WORLD_SIZE)]
    nnodes: Annotated[int, Strict(), Field(ge=1, le=MAX_NNODES)]
    nproc_per_host: Annotated[int, Strict(), Field(ge=1, le=MAX_NPROC_PER_HOST)]
    collector_host: _Host
    """Canonical host name (:func:`~kiln.system.ranks.canonical_host`), as participants' hosts are."""
    collector_pid: _Pid
    rank0_pid: _Pid
    tensor_parallel_groups: _Groups
    """Every distinct TP group the ranks reported, members ascending, groups by first member."""
    pipeline_parallel_groups: _Groups
    data_parallel_groups: Optional[_Groups]
    """None when the layout created no DP groups."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise AcquisitionRecordError(
                f"invalid acquisition record ({exc.error_count()} problem(s)): {problems_of(exc)}"
            ) from None

    @classmethod
    def from_json_value(cls, value: Any) -> "AcquisitionRecord":
        """Validate a record read from JSON (arrays stand for the tuples)."""
        if not isinstance(value, dict):
            raise AcquisitionRecordError(f"an acquisition record is a JSON object, got {type(value).__name__}")
        return cls(**value)

    @model_validator(mode="after")
    def _consistent_in_itself(self) -> "AcquisitionRecord":
        problems: list[str] = []
        if self.nnodes * self.nproc_per_host != self.world_size:
            problems.append(
                f"nnodes={self.nnodes} x nproc_per_host={self.nproc_per_host} is not world_size={self.world_size}"
            )
        try:
            started, finished = datetime.fromisoformat(self.started_at), datetime.fromisoformat(self.finished_at)
        except ValueError:
            problems.append("started_at and finished_at must be ISO 8601 timestamps")
        else:
            if started.utcoffset() is None or finished.utcoffset() is None:
                problems.append("started_at and finished_at must carry a UTC offset")
            elif finished < started:
                problems.append("finished_at is before started_at")
        families = {
            "tensor_parallel_groups": self.tensor_parallel_groups,
            "pipeline_parallel_groups": self.pipeline_parallel_groups,
        }
        if self.data_parallel_groups is not None:
            families["data_parallel_groups"] = self.data_parallel_groups
        partitions: dict[str, list[int]] = {}
        for name, groups in families.items():
            problem = _partition_problem(groups, self.world_size)
            if problem:
                problems.append(f"{name} {problem}")
            else:
                partitions[name] = _group_index(groups, self.world_size)
        names = sorted(partitions)
        for i, first in enumerate(names):
            for second in names[i + 1:]:
                pairs = set(zip(partitions[first], partitions[second], strict=True))
                if len(pairs) != self.world_size:
                    problems.append(f"a group of {first} shares more than one rank with a group of {second}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def group_size(self, family: Literal["tensor", "pipeline", "data"]) -> int:
        groups = getattr(self, f"{family}_parallel_groups")
        return 1 if groups is None else len(groups[0])


def _partition_problem(groups: tuple[tuple[int, ...], ...], world_size: int) -> str | None:
    """Why ``groups`` are not equal-sized, canonically ordered groups partitioning the world; None if they are."""
    if any(not g for g in groups):
        return "contain an empty group"
    if any(list(g) != sorted(set(g)) for g in groups):
        return "must list each group's ranks once, ascending"
    if list(groups) != sorted(groups):
        return "must be ordered by their first rank"
    if len({len(g) for g in groups}) != 1:
        return "are not all the same size"
    members = [r for g in groups for r in g]
    if len(members) != len(set(members)):
        return "overlap: a rank is in two groups"
    if set(members) != set(range(world_size)):
        return f"do not cover exactly the ranks 0..{world_size - 1}"
    return None


def _group_index(groups: tuple[tuple[int, ...], ...], world_size: int) -> list[int]:
    index = [0] * world_size
    for i, group in enumerate(groups):
        for r in group:
            index[r] = i
    return index


def record_observation_problems(record: AcquisitionRecord, obs: DeclaredObservation) -> list[str]:
    """Ways the record and the observation it was acquired with contradict each other."""
    problems = []
    if record.world_size != obs.world_size:
        problems.append(f"the record's world size {record.world_size} is not the observation's {obs.world_size}")
    for family in ("tensor", "pipeline", "data"):
        recorded, declared = record.group_size(family), getattr(obs, f"{family}_parallel_size")  # type: ignore[arg-type]
        if recorded != declared:
            problems.append(f"the record's {family}-parallel groups have {recorded} rank(s), "
                            f"the observation declares {family}_parallel_size={declared}")
    tp_rank_of: dict[int, int] = {r: g.index(r) for g in record.tensor_parallel_groups for r in g}
    for p in obs.participants:
        expected = tp_rank_of.get(p.global_rank)
        if expected is not None and p.tensor_parallel_rank != expected:
            problems.append(f"global rank {p.global_rank} reports TP rank {p.tensor_parallel_rank}, "
                            f"its recorded TP group places it at {expected}")
    rank0 = [p for p in obs.participants if p.global_rank == 0]
    if len(rank0) == 1 and (rank0[0].host, rank0[0].host_local_worker_process_key) != (
        record.collector_host, str(record.rank0_pid)
    ):
        problems.append("rank 0 is not the recorded rank0_pid on the collector host")
    if any(p.host == record.collector_host and p.host_local_worker_process_key == str(record.collector_pid)
           for p in obs.participants):
        problems.append("the collector, which runs no rank, appears as a participant")
    return problems


