"""Acquire a rank population from a real torch.distributed (gloo) world.

The law in :mod:`kiln.system.ranks` decides declared observations and claims
nothing about where they came from. This adapter is the part that *does*
acquire: it spawns one fresh interpreter per local rank (the ``spawn`` start
method of ``multiprocessing``, which ``torch.multiprocessing.spawn`` also uses;
the supervising process itself never imports torch) and has them form a gloo
world over a TCP rendezvous. Then, in every rank:

* the caller's *layout* runs and creates the tensor-parallel and
  pipeline-parallel process groups (and optionally data-parallel ones) with
  ``torch.distributed.new_group``, as vLLM and torchrun programs do, and hands
  back the groups this rank belongs to (:class:`ParallelGroups`);
* the rank reports what it observes, and nothing the adapter assumed: its
  global rank and the world size it sees, its rank in and the members of each
  group it was handed, its host name, its pid, and the incarnation it was
  launched into (the plan's incarnation on its own host, unless the layout names
  another, as a worker of another engine would).

Rank 0 gathers the reports; the supervisor on node 0 projects them into a
:class:`~kiln.system.ranks.DeclaredObservation` (group sizes come from the
groups the ranks reported, each participant's TP rank and incarnation from that
participant) and decides it.

Provenance lives here and only here. An :class:`AcquisitionOutcome`, and the
:class:`RankPopulationReceipt` a coherent outcome yields, are minted only by
:func:`acquire_rank_population`; they have no public constructor and cannot be
deserialised. A JSON document of an outcome read back is
:class:`AcquisitionEvidence`: it is re-checked (record consistent in itself,
record and observation consistent with each other, decision the law's) and is
never a receipt.

torch is imported only inside the spawned ranks, so importing this module, and
supervising a world, is cheap.
"""

from __future__ import annotations

import hashlib
import hmac
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
from typing import Any, Callable, NoReturn, Optional

from pydantic import ValidationError

from kiln.canonical import CanonicalJSONError, atomic_write_json, canonical_json_bytes, strict_json_loads
from kiln.system.ranks import (
    DeclaredObservation,
    ObservationInputError,
    Participant,
    RankPopulationDecision,
    decide_rank_population,
    parse_observation_json,
)

from kiln.cluster.acquire_record import (  # noqa: F401  (the plan, layout, record and errors: this module's API)
    ACQUISITION_METHOD,
    DEFAULT_MASTER_ADDR,
    DEFAULT_TIMEOUT_S,
    MAX_NNODES,
    MAX_NPROC_PER_HOST,
    MAX_REPORT_BYTES,
    MAX_TIMEOUT_S,
    COLLECTIVES_PER_WORLD,
    INCARNATION_TOKEN_BYTES,
    MAX_ERROR_CHARS,
    SUPERVISION_SLACK_S,
    AcquisitionConfigError,
    AcquisitionError,
    AcquisitionRecord,
    AcquisitionRecordError,
    EvidenceError,
    GridLayout,
    Layout,
    NotCoherentError,
    ParallelGroups,
    ReceiptForgeryError,
    WorldPlan,
    problems_of,
    record_observation_problems,
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
    "AcquisitionRecordError",
    "EvidenceError",
    "NotCoherentError",
    "ReceiptForgeryError",
    "AcquisitionRecord",
    "AcquisitionOutcome",
    "RankPopulationReceipt",
    "AcquisitionEvidence",
    "ParallelGroups",
    "GridLayout",
    "WorldPlan",
    "acquire_rank_population",
]
# -------------------------------------------------------------- outcome/receipt

class _Acquired:
    """An observation joined to the record of its acquisition and the law's decision.

    What it proves, precisely: that in *this process*, :func:`acquire_rank_population`
    acquired exactly this record and this observation and the law made this decision
    of them. How that is enforced:

    * no constructor, keyword or module attribute mints one: minting lives in a
      closure (:func:`_minting_authority`) together with a random per-process key;
    * every instance carries an HMAC-SHA256 tag, under that key, over its class name
      and the canonical JSON of record, observation and decision;
    * every use (the three attributes, ``coherent``, :meth:`to_json_dict`, ``==``,
      ``hash``) recomputes the canonical JSON and checks the tag, so an instance made
      with ``object.__new__`` and ``object.__setattr__``, a field swapped or mutated in
      place, an outcome re-typed as a receipt, or a tag copied onto other contents
      raises :class:`ReceiptForgeryError`.

    Not defended: code in the same interpreter that reads the key out of the closure
    (``__closure__``, ``gc``, ``ctypes``, a debugger). Python has no in-process
    capability isolation; a receipt guards against mistakes and casual forgery, not
    against hostile code running in the same process. Serialise with
    :meth:`to_json_dict`; a document read back is :class:`AcquisitionEvidence`.
    """

    __slots__ = ("_sealed",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ReceiptForgeryError(
            f"a {type(self).__name__} is minted only by kiln.cluster.acquire.acquire_rank_population; "
            "an observation and record from anywhere else are evidence: use AcquisitionEvidence"
        )

    def _contents(self) -> tuple[AcquisitionRecord, DeclaredObservation, RankPopulationDecision]:
        return _verify_sealed(self)

    @property
    def acquisition(self) -> AcquisitionRecord:
        return self._contents()[0]

    @property
    def observation(self) -> DeclaredObservation:
        return self._contents()[1]

    @property
    def decision(self) -> RankPopulationDecision:
        return self._contents()[2]

    @property
    def coherent(self) -> bool:
        return self._contents()[2].coherent

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self) -> NoReturn:
        raise ReceiptForgeryError(
            f"a {type(self).__name__} is not pickled or copied into being; serialise it with to_json_dict"
        )

    def __copy__(self) -> "_Acquired":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Acquired":
        return self

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._contents() == other._contents()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), *self._contents()))

    def __repr__(self) -> str:
        try:
            _acq, obs, decision = self._contents()
        except ReceiptForgeryError:
            return f"<forged {type(self).__name__}>"
        return f"{type(self).__name__}(decision={decision.decision!r}, world_size={obs.world_size})"

    def to_json_dict(self) -> dict[str, Any]:
        """The decision's own JSON (``decision``, ``findings``) followed by the record and observation."""
        return _outcome_json(*self._contents())

    @classmethod
    def from_json_dict(cls, value: Any) -> NoReturn:
        raise ReceiptForgeryError(
            f"a {cls.__name__} is never deserialised: a document is evidence, not a credential. "
            "Use AcquisitionEvidence.from_json_dict to re-check it, or acquire the population again"
        )


def _outcome_json(record: AcquisitionRecord, obs: DeclaredObservation, decision: RankPopulationDecision) -> dict[str, Any]:
    return {
        **decision.to_json_dict(),
        "acquisition": record.model_dump(mode="json"),
        "observation": obs.model_dump(mode="json"),
    }


class AcquisitionOutcome(_Acquired):
    """An acquired observation, its record and the law's decision, coherent or not."""

    __slots__ = ()

    def receipt(self) -> "RankPopulationReceipt":
        return _receipt_of(self)


class RankPopulationReceipt(_Acquired):
    """A coherent decision joined to the record of the acquisition it decided."""

    __slots__ = ()


def _minting_authority():  # type: ignore[no-untyped-def]
    """The per-process key and the only two functions that mint with it, held in closures.

    Returns (verify, receipt_of, mint_outcome); the module keeps ``verify`` and
    ``receipt_of`` as plain functions and passes ``mint_outcome`` only into
    :func:`acquire_rank_population`'s closure, so no module attribute mints.
    """
    key = secrets.token_bytes(32)

    def tag(kind: str, record: Any, obs: Any, decision: Any) -> bytes:
        body = canonical_json_bytes({"kind": kind, **_outcome_json(record, obs, decision)})
        return hmac.new(key, body, hashlib.sha256).digest()

    def mint(cls: type, record: AcquisitionRecord, obs: DeclaredObservation,
             decision: RankPopulationDecision) -> Any:
        instance: Any = object.__new__(cls)
        object.__setattr__(instance, "_sealed", (record, obs, decision, tag(cls.__name__, record, obs, decision)))
        return instance

    def verify(instance: _Acquired) -> tuple[AcquisitionRecord, DeclaredObservation, RankPopulationDecision]:
        forged = ReceiptForgeryError(
            f"this {type(instance).__name__} was not minted by acquire_rank_population in this process, or was "
            "altered after minting"
        )
        try:
            sealed = object.__getattribute__(instance, "_sealed")
        except AttributeError:
            raise forged from None
        if not (isinstance(sealed, tuple) and len(sealed) == 4 and isinstance(sealed[0], AcquisitionRecord)
                and isinstance(sealed[1], DeclaredObservation) and isinstance(sealed[2], RankPopulationDecision)
                and isinstance(sealed[3], bytes)):
            raise forged
        record, obs, decision, seal = sealed
        try:
            expected = tag(type(instance).__name__, record, obs, decision)
        except Exception:  # noqa: BLE001 - contents mutated into something unserialisable
            raise forged from None
        if not hmac.compare_digest(seal, expected):
            raise forged
        return record, obs, decision

    def receipt_of(outcome: AcquisitionOutcome) -> RankPopulationReceipt:
        record, obs, decision = verify(outcome)
        if not decision.coherent:
            raise NotCoherentError(f"no receipt: the law refused this population ({', '.join(decision.kinds)})")
        return mint(RankPopulationReceipt, record, obs, decision)

    def mint_outcome(record: AcquisitionRecord, obs: DeclaredObservation,
                     decision: RankPopulationDecision) -> AcquisitionOutcome:
        return mint(AcquisitionOutcome, record, obs, decision)

    return verify, receipt_of, mint_outcome


_verify_sealed, _receipt_of, _mint_outcome_once = _minting_authority()


@dataclass(frozen=True)
class AcquisitionEvidence:
    """An outcome document read back: re-checked, never a receipt.

    Construction checks that the record is consistent in itself, that record and
    observation agree (world size, group sizes, each TP rank's place in its
    recorded group, rank 0 on the collector host), and that the decision is the
    one the law makes of the observation. Passing those checks says the document
    holds together, not that any world ever produced it: anyone can write a
    consistent one. Trust needs an acquisition of one's own.
    """

    acquisition: AcquisitionRecord
    observation: DeclaredObservation
    decision: RankPopulationDecision

    def __post_init__(self) -> None:
        problems = record_observation_problems(self.acquisition, self.observation)
        if problems:
            raise EvidenceError(f"the record and the observation disagree: {'; '.join(problems)}")
        if decide_rank_population(self.observation) != self.decision:
            raise EvidenceError("the decision is not the law's decision for this observation")

    @property
    def coherent(self) -> bool:
        return self.decision.coherent

    def to_json_dict(self) -> dict[str, Any]:
        return _outcome_json(self.acquisition, self.observation, self.decision)

    @classmethod
    def from_json_dict(cls, value: Any) -> "AcquisitionEvidence":
        """Re-check an outcome document; typed errors name what does not hold."""
        known = {"decision", "findings", "acquisition", "observation"}
        if not isinstance(value, dict) or set(value) != known:
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise EvidenceError(f"an outcome document has exactly the fields {sorted(known)}, got {got}")
        record = AcquisitionRecord.from_json_value(value["acquisition"])
        try:
            observation = parse_observation_json(json.dumps(value["observation"]).encode())
        except (ObservationInputError, TypeError, ValueError) as exc:
            raise EvidenceError(f"the observation: {exc}") from None
        try:
            decision = RankPopulationDecision.model_validate(
                {"decision": value["decision"], "findings": value["findings"]}
            )
        except ValidationError as exc:
            raise EvidenceError(f"the decision: {problems_of(exc)}") from None
        return cls(acquisition=record, observation=observation, decision=decision)


# ----------------------------------------------------------------- acquisition


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _acquirer(mint_outcome: Callable[..., AcquisitionOutcome]):  # type: ignore[no-untyped-def]
    """Bind the outcome minter into :func:`acquire_rank_population`'s closure only."""

    def acquire_rank_population(plan: WorldPlan, layout: Optional[Layout] = None) -> AcquisitionOutcome | None:
        """Start this host's share of the world and, on node 0, decide what it reports.

        ``layout`` creates the process groups in every rank (default: pure tensor
        parallelism over the whole world, ``GridLayout(plan.world_size)``). Returns
        the outcome on node 0 and ``None`` on every other node (their reports travel
        to rank 0 through the gather). Raises :class:`AcquisitionError` when the
        world does not form, a worker fails, or the groups the ranks report are not
        a decomposition the observation can express.
        """
        acquired = _acquire(plan, layout)
        return None if acquired is None else mint_outcome(*acquired)

    return acquire_rank_population


acquire_rank_population = _acquirer(_mint_outcome_once)
del _mint_outcome_once


def _acquire(
    plan: WorldPlan, layout: Optional[Layout]
) -> tuple[AcquisitionRecord, DeclaredObservation, RankPopulationDecision] | None:
    """The work of :func:`acquire_rank_population`, returning plain (record, observation, decision)."""
    layout = layout if layout is not None else GridLayout(plan.world_size)
    incarnation = plan.incarnation or secrets.token_hex(INCARNATION_TOKEN_BYTES)
    port = plan.master_port or _free_port(plan.master_addr)
    started_at = _utc_now()
    with tempfile.TemporaryDirectory(prefix="kiln-ranks-") as tmp:
        failure = _run_workers(plan, port, incarnation, layout, Path(tmp))
        if failure is not None:
            raise AcquisitionError(
                f"the gloo world at {plan.master_addr}:{port} did not complete "
                f"(node {plan.node_rank} of {plan.nnodes}): {failure}. "
                "Check that every host runs the same plan, that master_addr is reachable, "
                "and GLOO_SOCKET_IFNAME if the host name does not resolve"
            )
        if plan.node_rank != 0:
            return None
        gathered = _read_report(Path(tmp) / "gathered.json")
    finished_at = _utc_now()

    try:
        record, observation = _project(gathered, plan, port, incarnation, started_at, finished_at)
    except AcquisitionRecordError as exc:
        raise AcquisitionError(f"the process groups the ranks reported are not a decomposition: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise AcquisitionError(
            f"rank 0's gathered reports do not project into an observation: {exc}. "
            "Every host must run the same kiln version"
        ) from None
    problems = record_observation_problems(record, observation)
    if problems:
        raise AcquisitionError(f"the ranks' reports contradict each other: {'; '.join(problems)}")
    return record, observation, decide_rank_population(observation)


def _project(
    gathered: dict[str, Any], plan: WorldPlan, port: int, incarnation: str, started_at: str, finished_at: str
) -> tuple[AcquisitionRecord, DeclaredObservation]:
    """Project rank 0's gathered reports into the record and the law's declared observation."""
    reports: list[Any] = gathered["reports"]
    present = [r for r in reports if r is not None]
    seen_sizes = sorted({r["world_size"] for r in present})
    if seen_sizes != [plan.world_size]:
        raise ValueError(f"the ranks see world sizes {seen_sizes}, the plan has {plan.world_size}")

    def groups(key: str) -> tuple[tuple[int, ...], ...]:
        return tuple(sorted({tuple(r[key]) for r in present}))

    given_dp = {r["data_parallel_ranks"] is not None for r in present}
    if len(given_dp) > 1:
        raise ValueError("some ranks were given a data-parallel group and others none")
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
        rank0_pid=reports[0]["pid"],
        tensor_parallel_groups=groups("tensor_parallel_ranks"),
        pipeline_parallel_groups=groups("pipeline_parallel_ranks"),
        data_parallel_groups=groups("data_parallel_ranks") if given_dp == {True} else None,
    )
    observation = DeclaredObservation(
        incarnation=incarnation,
        returned_completely=len(present) == len(reports) == plan.world_size,
        world_size=plan.world_size,
        tensor_parallel_size=record.group_size("tensor"),
        pipeline_parallel_size=record.group_size("pipeline"),
        data_parallel_size=record.group_size("data"),
        selected_hosts=plan.selected_hosts or (socket.gethostname(),),
        participants=tuple(
            Participant(
                global_rank=r["global_rank"],
                tensor_parallel_rank=r["tensor_parallel_rank"],
                host=r["host"],
                host_local_worker_process_key=str(r["pid"]),
                incarnation=r["incarnation"],
            )
            for r in present
        ),
    )
    return record, observation


def _run_workers(plan: WorldPlan, port: int, incarnation: str, layout: Layout, workdir: Path) -> str | None:
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
            target=_worker,
            args=(local_rank, plan, port, incarnation, layout, str(workdir)),
            name=f"kiln-rank-{local_rank}",
            daemon=True,
        )
        for local_rank in range(plan.nproc_per_host)
    ]
    for proc in procs:
        proc.start()
    allowed_s = plan.timeout_s * COLLECTIVES_PER_WORLD + SUPERVISION_SLACK_S
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
                proc = pending.pop(sentinel)  # type: ignore[arg-type]  # the keys are the sentinels waited on
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
        return path.read_text(encoding="utf-8", errors="replace")[:MAX_ERROR_CHARS].strip()
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


def _worker(local_rank: int, plan: WorldPlan, port: int, incarnation: str, layout: Layout, workdir: str) -> None:
    """Entry point of one spawned rank: run it, leave a one-line reason on failure."""
    try:
        _rank_main(local_rank, plan, port, incarnation, layout, Path(workdir) / "gathered.json")
    except BaseException as exc:  # noqa: BLE001  (reported to the supervisor, then exit 1)
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": .")
        Path(workdir, f"error-{local_rank}.txt").write_text(reason, encoding="utf-8")
        sys.exit(1)


def _rank_main(local_rank: int, plan: WorldPlan, port: int, incarnation: str, layout: Layout,
               report_path: Path) -> None:
    """One rank of the world: join, let the layout make its groups, report, and (rank 0) write the reports."""
    import torch
    import torch.distributed as dist

    rank = plan.node_rank * plan.nproc_per_host + local_rank
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{plan.master_addr}:{port}",
        rank=rank,
        world_size=plan.world_size,
        timeout=timedelta(seconds=plan.timeout_s),
    )
    try:
        groups = layout(rank, plan.world_size)
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"the layout returned {type(groups).__name__}, not ParallelGroups")
        tp_rank, tp_ranks = _membership(groups.tensor_parallel, "tensor-parallel")
        pp_rank, pp_ranks = _membership(groups.pipeline_parallel, "pipeline-parallel")
        dp_rank, dp_ranks = (None, None) if groups.data_parallel is None else _membership(
            groups.data_parallel, "data-parallel"
        )
        report = {
            "global_rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "tensor_parallel_rank": tp_rank,
            "tensor_parallel_ranks": tp_ranks,
            "pipeline_parallel_rank": pp_rank,
            "pipeline_parallel_ranks": pp_ranks,
            "data_parallel_rank": dp_rank,
            "data_parallel_ranks": dp_ranks,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "incarnation": groups.incarnation if groups.incarnation is not None else incarnation,
        }
        gathered: list[Any] | None = [None] * plan.world_size if rank == 0 else None
        dist.gather_object(report, gathered, dst=0)
        if rank == 0:
            atomic_write_json(report_path, {"torch_version": str(torch.__version__), "reports": gathered})
    finally:
        dist.destroy_process_group()


def _membership(group: Any, what: str) -> tuple[int, list[int]]:
    """This rank's rank in ``group`` and the group's members (global ranks, ascending)."""
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        raise AcquisitionConfigError(
            f"rank {dist.get_rank()} was handed no {what} group it belongs to (got {group!r}); "
            "the layout must return the group holding this rank"
        )
    return dist.get_rank(group=group), sorted(dist.get_process_group_ranks(group))
