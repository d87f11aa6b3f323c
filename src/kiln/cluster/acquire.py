"""Acquire a rank population from a real torch.distributed (gloo) world.

The law in :mod:`kiln.cluster.ranks` decides declared observations and claims
nothing about where they came from. This adapter is the part that *does*
acquire: it spawns one fresh interpreter per local rank (the ``spawn`` start
method of ``multiprocessing``, which ``torch.multiprocessing.spawn`` also uses;
the supervising process itself never imports torch), has them form a gloo
process group over a TCP rendezvous, builds one tensor-parallel
group spanning the whole world (so pipeline and data parallel degrees are 1),
and lets every rank report:

* its global rank and its rank inside the TP group,
* its host identity (the host name of the UTS namespace it runs in),
* its host-local process key (its pid),
* the incarnation ID of this rendezvous: rank 0 draws a random token and
  broadcasts it over the group, so only members of this world can echo it.

Rank 0 gathers the reports, the collector projects them into a
:class:`~kiln.cluster.ranks.DeclaredObservation` and decides it. The
:class:`AcquisitionRecord` (how, when, from where) stays beside the decision;
only a coherent decision joined to its record forms a
:class:`RankPopulationReceipt`.

For several hosts run the same command on every host with ``nnodes``,
``node_rank`` and a reachable ``master_addr``/``master_port``; the collector is
node 0. Set ``GLOO_SOCKET_IFNAME`` where the host name does not resolve to the
interface the other hosts can reach.

torch is imported only inside the spawned ranks, so importing this module, and
supervising a world, is cheap.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

from typing_extensions import Self

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kiln.canonical import CanonicalJSONError, atomic_write_json, strict_json_loads
from kiln.cluster.ranks import (
    MAX_IDENTIFIER_CHARS,
    DeclaredObservation,
    Participant,
    RankPopulationDecision,
    decide_rank_population,
)

__all__ = [
    "ACQUISITION_METHOD",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_TIMEOUT_S",
    "MAX_NNODES",
    "MAX_NPROC_PER_HOST",
    "MAX_TIMEOUT_S",
    "MAX_REPORT_BYTES",
    "AcquisitionError",
    "AcquisitionConfigError",
    "NotCoherentError",
    "AcquisitionRecord",
    "AcquisitionOutcome",
    "RankPopulationReceipt",
    "WorldPlan",
    "acquire_rank_population",
]

ACQUISITION_METHOD = "multiprocessing.spawn+gloo"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_TIMEOUT_S = 60.0
"""Seconds the rendezvous and each collective may wait for missing peers."""
MAX_TIMEOUT_S = 3600.0
MAX_NPROC_PER_HOST = 256
MAX_NNODES = 4096
MAX_REPORT_BYTES = 64 << 20
"""Largest gathered report file the collector reads back, in bytes."""
_INCARNATION_TOKEN_BYTES = 16
_COLLECTIVES_PER_WORLD = 4
"""Rendezvous, group creation, broadcast, gather: each may wait ``timeout_s``."""
_SUPERVISION_SLACK_S = 60.0
"""Extra seconds the supervisor allows for interpreter and torch start-up."""
_MAX_ERROR_CHARS = 2000


class AcquisitionError(RuntimeError):
    """The world could not be formed or did not report back."""


class AcquisitionConfigError(ValueError):
    """The requested world is not a valid plan (bad sizes, ranks or hosts)."""


class NotCoherentError(ValueError):
    """A receipt was requested for a population the law refused."""


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
        for host in self.selected_hosts:
            if not 1 <= len(host) <= MAX_IDENTIFIER_CHARS:
                raise AcquisitionConfigError(
                    f"selected host {host!r} must be 1 to {MAX_IDENTIFIER_CHARS} characters long"
                )
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise AcquisitionConfigError(f"timeout_s={self.timeout_s} must be in (0, {MAX_TIMEOUT_S}]")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_host


# ---------------------------------------------------------------- record/receipt

_MODEL = ConfigDict(frozen=True, extra="forbid")


class AcquisitionRecord(BaseModel):
    """How, when and from where an observation was acquired."""

    model_config = _MODEL

    method: Literal["multiprocessing.spawn+gloo"]
    """How the world was started and which torch.distributed backend it used."""
    backend: Literal["gloo"]
    torch_version: str
    started_at: str
    """UTC, ISO 8601, when the collector began starting its workers."""
    finished_at: str
    """UTC, ISO 8601, when the gathered reports were back with the collector."""
    master_addr: str
    master_port: int
    world_size: int
    nnodes: int
    nproc_per_host: int
    collector_host: str
    collector_pid: int
    rank0_pid: int
    tensor_parallel_group_ranks: tuple[int, ...]


class _OutcomeFields(BaseModel):
    model_config = _MODEL

    acquisition: AcquisitionRecord
    observation: DeclaredObservation
    decision: RankPopulationDecision

    @model_validator(mode="after")
    def _decision_is_the_laws(self) -> "_OutcomeFields":
        if decide_rank_population(self.observation) != self.decision:
            raise ValueError("the decision is not the law's decision for this observation")
        if self.acquisition.world_size != self.observation.world_size:
            raise ValueError("the acquisition record and the observation disagree on the world size")
        return self

    def to_json_dict(self) -> dict[str, Any]:
        """The decision's own JSON (``decision``, ``findings``) followed by the record and observation."""
        return {
            **self.decision.to_json_dict(),
            "acquisition": self.acquisition.model_dump(mode="json"),
            "observation": self.observation.model_dump(mode="json"),
        }

    @classmethod
    def from_json_dict(cls, value: dict[str, Any]) -> Self:
        """Rebuild from :meth:`to_json_dict` output; the decision is re-derived and must agree."""
        known = {"decision", "findings", "acquisition", "observation"}
        if set(value) != known:
            raise ValueError(f"expected exactly the fields {sorted(known)}, got {sorted(value)}")
        return cls.model_validate(
            {
                "acquisition": value["acquisition"],
                "observation": DeclaredObservation.model_validate_json(json.dumps(value["observation"])),
                "decision": {"decision": value["decision"], "findings": value["findings"]},
            }
        )


class AcquisitionOutcome(_OutcomeFields):
    """An acquired observation, its record and the law's decision, coherent or not."""

    def receipt(self) -> "RankPopulationReceipt":
        if not self.decision.coherent:
            raise NotCoherentError(
                f"no receipt: the law refused this population ({', '.join(self.decision.kinds)})"
            )
        return RankPopulationReceipt(
            acquisition=self.acquisition, observation=self.observation, decision=self.decision
        )


class RankPopulationReceipt(_OutcomeFields):
    """A coherent decision joined to the record of the acquisition it decided."""

    @model_validator(mode="after")
    def _only_coherent(self) -> "RankPopulationReceipt":
        if not self.decision.coherent:
            raise ValueError("a receipt needs a coherent decision")
        return self


# ----------------------------------------------------------------- acquisition


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def acquire_rank_population(plan: WorldPlan) -> AcquisitionOutcome | None:
    """Start this host's share of the world and, on node 0, decide what it reports.

    Returns the outcome on node 0 and ``None`` on every other node (their
    reports travel to rank 0 through the gather). Raises
    :class:`AcquisitionError` when the world does not form or a worker fails.
    """
    port = plan.master_port or _free_port(plan.master_addr)
    started_at = _utc_now()
    with tempfile.TemporaryDirectory(prefix="kiln-ranks-") as tmp:
        report_path = Path(tmp) / "gathered.json"
        failure = _run_workers(plan, port, Path(tmp))
        if failure is not None:
            raise AcquisitionError(
                f"the gloo world at {plan.master_addr}:{port} did not complete "
                f"(node {plan.node_rank} of {plan.nnodes}): {failure}. "
                "Check that every host runs the same plan, that master_addr is reachable, "
                "and GLOO_SOCKET_IFNAME if the host name does not resolve"
            )
        if plan.node_rank != 0:
            return None
        gathered = _read_report(report_path)
    finished_at = _utc_now()

    try:
        observation = _project(gathered, plan)
        record = AcquisitionRecord(
            method=ACQUISITION_METHOD,
            backend="gloo",
            torch_version=gathered["torch_version"],
            started_at=started_at,
            finished_at=finished_at,
            master_addr=plan.master_addr,
            master_port=port,
            world_size=plan.world_size,
            nnodes=plan.nnodes,
            nproc_per_host=plan.nproc_per_host,
            collector_host=socket.gethostname(),
            collector_pid=os.getpid(),
            rank0_pid=gathered["rank0_pid"],
            tensor_parallel_group_ranks=tuple(gathered["tensor_parallel_group_ranks"]),
        )
    except (KeyError, TypeError, ValidationError) as exc:
        raise AcquisitionError(
            f"rank 0's gathered reports do not project into an observation: {exc}. "
            "Every host must run the same kiln version"
        ) from None
    return AcquisitionOutcome(
        acquisition=record, observation=observation, decision=decide_rank_population(observation)
    )


def _run_workers(plan: WorldPlan, port: int, workdir: Path) -> str | None:
    """Spawn this host's ranks and wait for them; ``None`` on success, else why not.

    A fresh interpreter per rank (the ``spawn`` start method, as
    ``torch.multiprocessing.spawn`` uses) keeps torch out of this supervising
    process. When one rank fails the others are stopped at once instead of
    waiting out their collective timeouts.
    """
    ctx = multiprocessing.get_context("spawn")
    procs = [
        # daemon: if this supervisor exits, its ranks do not outlive it.
        ctx.Process(
            target=_worker, args=(local_rank, plan, port, str(workdir)), name=f"kiln-rank-{local_rank}", daemon=True
        )
        for local_rank in range(plan.nproc_per_host)
    ]
    for proc in procs:
        proc.start()
    allowed_s = plan.timeout_s * _COLLECTIVES_PER_WORLD + _SUPERVISION_SLACK_S
    deadline = time.monotonic() + allowed_s
    failure: str | None = None
    try:
        pending = {proc.sentinel: proc for proc in procs}
        while pending and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failure = f"the workers were still running after {allowed_s:.0f} s"
                break
            for sentinel in multiprocessing.connection.wait(list(pending), timeout=remaining):
                proc = pending.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    failure = _worker_failure(workdir, proc)
                    break
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    return failure


def _worker_failure(workdir: Path, proc: Any) -> str:
    local_rank = int(proc.name.rsplit("-", 1)[1])
    path = workdir / f"error-{local_rank}.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")[:_MAX_ERROR_CHARS].strip()
    return f"local rank {local_rank} exited with code {proc.exitcode}"


def _read_report(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise AcquisitionError("rank 0 finished without writing its gathered reports") from None
    if size > MAX_REPORT_BYTES:
        raise AcquisitionError(f"the gathered reports are {size} bytes, over the {MAX_REPORT_BYTES}-byte limit")
    try:
        value = strict_json_loads(path.read_bytes())
    except (CanonicalJSONError, UnicodeDecodeError) as exc:
        raise AcquisitionError(f"rank 0 wrote unreadable gathered reports: {exc}") from None
    if not isinstance(value, dict):
        raise AcquisitionError("rank 0 wrote gathered reports that are not a JSON object")
    return value


def _project(gathered: dict[str, Any], plan: WorldPlan) -> DeclaredObservation:
    """Project rank 0's gathered reports into the law's declared observation."""
    reports = gathered["reports"]
    participants = tuple(
        Participant(
            global_rank=r["global_rank"],
            tensor_parallel_rank=r["tensor_parallel_rank"],
            host=r["host"],
            host_local_worker_process_key=str(r["pid"]),
            incarnation=r["incarnation"],
        )
        for r in reports
        if r is not None
    )
    selected = plan.selected_hosts or (socket.gethostname(),)
    return DeclaredObservation(
        incarnation=gathered["incarnation"],
        returned_completely=all(r is not None for r in reports) and len(reports) == gathered["world_size"],
        world_size=gathered["world_size"],
        tensor_parallel_size=gathered["tensor_parallel_size"],
        pipeline_parallel_size=1,
        data_parallel_size=1,
        selected_hosts=tuple(selected),
        participants=participants,
    )


def _worker(local_rank: int, plan: WorldPlan, port: int, workdir: str) -> None:
    """Entry point of one spawned rank: run it, leave a one-line reason on failure."""
    try:
        _rank_main(local_rank, plan, port, Path(workdir) / "gathered.json")
    except BaseException as exc:  # noqa: BLE001  (reported to the supervisor, then exit 1)
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": .")
        Path(workdir, f"error-{local_rank}.txt").write_text(reason, encoding="utf-8")
        sys.exit(1)


def _rank_main(local_rank: int, plan: WorldPlan, port: int, report_path: Path) -> None:
    """One rank of the world: join, report, and (rank 0) write the gathered reports."""
    import torch
    import torch.distributed as dist

    rank = plan.node_rank * plan.nproc_per_host + local_rank
    world_size = plan.world_size
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{plan.master_addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=plan.timeout_s),
    )
    try:
        # Pure tensor parallelism: one TP group holding every rank, PP = DP = 1.
        tp_ranks = list(range(world_size))
        tp_group = dist.new_group(ranks=tp_ranks, backend="gloo")
        box: list[Any] = [secrets.token_hex(_INCARNATION_TOKEN_BYTES) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=tp_group)
        report = {
            "global_rank": dist.get_rank(),
            "tensor_parallel_rank": dist.get_rank(group=tp_group),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "incarnation": box[0],
        }
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(report, gathered, dst=0, group=tp_group)
        if rank == 0:
            atomic_write_json(
                report_path,
                {
                    "incarnation": box[0],
                    "world_size": dist.get_world_size(),
                    "tensor_parallel_size": dist.get_world_size(group=tp_group),
                    "tensor_parallel_group_ranks": tp_ranks,
                    "rank0_pid": os.getpid(),
                    "torch_version": str(torch.__version__),
                    "reports": gathered,
                },
            )
    finally:
        dist.destroy_process_group()
