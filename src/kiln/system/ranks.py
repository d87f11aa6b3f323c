"""The rank-population law for a tensor-parallel deployment.

Given a *declared* observation of the workers a deployment is running on
(which global rank and tensor-parallel rank each reports, on which host, under
which host-local process key and which incarnation), decide whether that
population is coherent, or refuse it with every finding at once.

This module is pure: standard library and pydantic only. It acquires nothing and
claims no provenance; an acquisition adapter (``kiln.cluster.acquire``, or the vLLM
supervisor in ``kiln.runtime.vllm_process``) owns the
record of how an observation was obtained and joins that record to the decision.

How the rank set is pinned without a caller-supplied list: the law demands that
the number of participants equals ``world_size``, that no global rank appears
twice and that every global rank lies in ``[0, world_size)``. Together these
force every rank of the range to appear exactly once (pigeonhole), so
completeness follows without enumerating the expected ranks.

Checks are independent of one another and all of them run; the decision lists
their findings in a stable order (by kind, in the order of ``FINDING_KINDS``,
then by the details that locate each finding).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter, defaultdict
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.canonical import CanonicalJSONError, strict_json_loads

__all__ = [
    "MAX_IDENTIFIER_CHARS",
    "MAX_OBSERVATION_BYTES",
    "MAX_PARTICIPANTS",
    "MAX_RANK_MAGNITUDE",
    "MAX_SELECTED_HOSTS",
    "MAX_WORLD_SIZE",
    "FINDING_KINDS",
    "ObservationInputError",
    "canonical_host",
    "Participant",
    "DeclaredObservation",
    "Finding",
    "RankPopulationDecision",
    "parse_observation_json",
    "decide_rank_population",
]

# ----------------------------------------------------------------------- limits

MAX_WORLD_SIZE = 1 << 20
"""Largest world size (and parallel degree) the law accepts as input."""
MAX_PARTICIPANTS = 1 << 16
"""Most participants one observation may list."""
MAX_SELECTED_HOSTS = 1 << 16
"""Most entries ``selected_hosts`` may list."""
MAX_IDENTIFIER_CHARS = 256
"""Longest host name, incarnation or process key, in characters."""
MAX_RANK_MAGNITUDE = (1 << 31) - 1
"""Largest absolute value of a declared global or tensor-parallel rank."""
MAX_OBSERVATION_BYTES = 8 << 20
"""Largest observation JSON document read, in bytes."""


class ObservationInputError(ValueError):
    """An observation is not valid input to the law (wrong shape, type or bound)."""


# ------------------------------------------------------------------ observation

_Identifier = Annotated[str, Field(min_length=1, max_length=MAX_IDENTIFIER_CHARS)]

_HOST_CHARS = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")


def canonical_host(name: object) -> str:
    """The host identity the law compares: one canonical spelling per machine name.

    Host names are case-insensitive and a single trailing dot (the DNS root) names
    the same host, so ``SPARK-3BD5``, ``spark-3bd5`` and ``spark-3bd5.`` are one
    host: the canonical form is lowercase without the trailing dot. An IP address
    literal (IPv4, or IPv6 with optional brackets) is written in its standard
    compressed form; every other spelling the resolver accepts as an IPv4 address
    (``3232261642``, ``0xc0a8660a``, ``127.1``) and an IPv4-mapped IPv6 address
    (``::ffff:192.168.102.10``) becomes the dotted quad, and a spelling with an
    octal-looking part (``192.168.102.010``) is refused as ambiguous. Anything else is refused with ``ValueError``: whitespace
    (leading, trailing or inside), control characters, empty labels (``a..b``) and
    characters outside letters, digits, ``-``, ``_`` and ``.``.
    """
    if not isinstance(name, str):
        raise ValueError("a host is a string")
    if not name or len(name) > MAX_IDENTIFIER_CHARS:
        raise ValueError(f"a host name has 1 to {MAX_IDENTIFIER_CHARS} characters")
    literal = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    numeric = _inet_aton_form(literal)
    if numeric is not None:
        return numeric
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        pass
    else:
        # An IPv4-mapped IPv6 address (::ffff:a.b.c.d) reaches the same machine as a.b.c.d.
        mapped = getattr(address, "ipv4_mapped", None)
        return str(mapped if mapped is not None else address)
    host = name.lower()
    if host.endswith(".") and len(host) > 1:
        host = host[:-1]
    if not _HOST_CHARS.fullmatch(host):
        raise ValueError(
            f"host {name!r} is not a host name or IP address (letters, digits, '-', '_' and dot-separated "
            "labels; no whitespace or control characters)"
        )
    return host


_NUMERIC_PART = re.compile(r"0x[0-9a-f]*|[0-9]+")


def _inet_aton_form(literal: str) -> str | None:
    """The dotted-quad address of a host spelled as the C resolver (``inet_aton``) reads numbers:
    one to four parts, each decimal or ``0x`` hex, the last filling the remaining bytes (``3232261642``,
    ``0xc0a8660a``, ``127.1``). ``None`` when it is not such a spelling. A part with a leading zero is
    octal to the resolver but decimal to a reader (``192.168.102.010`` is .8 to one, .10 to the other):
    refused as ambiguous rather than guessed."""
    parts = literal.lower().split(".")
    if not 1 <= len(parts) <= 4 or not all(_NUMERIC_PART.fullmatch(p) for p in parts):
        return None
    if any(len(p) > 1 and p.startswith("0") and not p.startswith("0x") for p in parts):
        raise ValueError(
            f"host {literal!r} is ambiguous: a part with a leading zero is octal to the resolver and decimal "
            "to a reader; write the address as a plain dotted quad"
        )
    if any(p == "0x" for p in parts):
        raise ValueError(f"host {literal!r} is not an address: '0x' without digits")
    values = [int(p, 16) if p.startswith("0x") else int(p) for p in parts]
    last_bits = 8 * (5 - len(values))
    if any(v > 255 for v in values[:-1]) or values[-1] >= 1 << last_bits:
        raise ValueError(f"host {literal!r} is not an IPv4 address (a part is out of range)")
    number = 0
    for v in values[:-1]:
        number = (number << 8) | v
    number = (number << last_bits) | values[-1]
    return str(ipaddress.IPv4Address(number))


_Host = Annotated[str, AfterValidator(canonical_host)]
# A negative rank, or one at or beyond world_size, is a *finding*
# (rank_out_of_range), not malformed input; the bound only keeps numbers sane.
_Rank = Annotated[int, Field(ge=-MAX_RANK_MAGNITUDE, le=MAX_RANK_MAGNITUDE)]
_Degree = Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class Participant(BaseModel):
    """One worker as the observation declares it."""

    model_config = _STRICT

    global_rank: _Rank
    tensor_parallel_rank: _Rank
    host: _Host
    """Canonicalised on input (:func:`canonical_host`): case, a trailing dot and IP spelling never make two hosts."""
    host_local_worker_process_key: _Identifier
    """Key of the worker process, meaningful only on its own host (a pid, say)."""
    incarnation: _Identifier


class DeclaredObservation(BaseModel):
    """A population of workers as declared to the law, with no provenance."""

    model_config = _STRICT

    incarnation: _Identifier
    returned_completely: bool
    world_size: _Degree
    tensor_parallel_size: _Degree
    pipeline_parallel_size: _Degree
    data_parallel_size: _Degree
    selected_hosts: Annotated[tuple[_Host, ...], Field(max_length=MAX_SELECTED_HOSTS)]
    participants: Annotated[tuple[Participant, ...], Field(max_length=MAX_PARTICIPANTS)]


def parse_observation_json(data: bytes) -> DeclaredObservation:
    """Parse and validate the JSON bytes of an observation.

    Duplicate keys, NaN/Infinity, unknown fields, wrong types (no coercion: ``"2"``
    is not ``2`` and ``1`` is not ``true``) and out-of-bound values are all
    rejected with an :class:`ObservationInputError` naming every offending field.
    """
    if len(data) > MAX_OBSERVATION_BYTES:
        raise ObservationInputError(
            f"the observation is larger than the {MAX_OBSERVATION_BYTES}-byte limit; "
            "split the deployment or check that the right file was given"
        )
    try:
        value = strict_json_loads(data)
    except (CanonicalJSONError, UnicodeDecodeError) as exc:
        raise ObservationInputError(f"the observation is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ObservationInputError(
            f"the observation must be a JSON object, got {type(value).__name__}; "
            "see docs/cluster.md for the expected fields"
        )
    try:
        return DeclaredObservation.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ObservationInputError(
            f"invalid observation ({exc.error_count()} problem(s)): {problems}. "
            "Fix these fields; see docs/cluster.md for the format"
        ) from None


# --------------------------------------------------------------------- findings


class _Finding(BaseModel):
    """Base of every finding: immutable, no fields beyond its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ParticipantCountMismatch(_Finding):
    kind: Literal["participant_count_mismatch"] = "participant_count_mismatch"
    world_size: int
    participant_count: int


class DuplicatedRank(_Finding):
    kind: Literal["duplicated_rank"] = "duplicated_rank"
    global_rank: int
    occurrences: int
    hosts: tuple[str, ...]


class RankOutOfRange(_Finding):
    kind: Literal["rank_out_of_range"] = "rank_out_of_range"
    global_rank: int
    host: str
    world_size: int


class ParticipantOnUnselectedHost(_Finding):
    kind: Literal["participant_on_unselected_host"] = "participant_on_unselected_host"
    global_rank: int
    host: str


class SelectedHostCarriedNoRank(_Finding):
    kind: Literal["selected_host_carried_no_rank"] = "selected_host_carried_no_rank"
    host: str


class SelectedHostNamedMoreThanOnce(_Finding):
    kind: Literal["selected_host_named_more_than_once"] = "selected_host_named_more_than_once"
    host: str
    occurrences: int


class RanksShareHostLocalWorkerProcessKey(_Finding):
    kind: Literal["ranks_share_host_local_worker_process_key"] = "ranks_share_host_local_worker_process_key"
    host: str
    process_key: str
    global_ranks: tuple[int, ...]


class ParticipantFromAnotherIncarnation(_Finding):
    kind: Literal["participant_from_another_incarnation"] = "participant_from_another_incarnation"
    global_rank: int
    host: str
    participant_incarnation: str
    observation_incarnation: str


class ObservationIncomplete(_Finding):
    kind: Literal["observation_incomplete"] = "observation_incomplete"
    participant_count: int


class NotATensorParallelDecomposition(_Finding):
    kind: Literal["not_a_tensor_parallel_decomposition"] = "not_a_tensor_parallel_decomposition"
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int


class DecompositionInconsistentWithWorldSize(_Finding):
    kind: Literal["decomposition_inconsistent_with_world_size"] = "decomposition_inconsistent_with_world_size"
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    product: int


class TensorParallelRankDoesNotMatchGlobalRank(_Finding):
    kind: Literal["tensor_parallel_rank_does_not_match_global_rank"] = (
        "tensor_parallel_rank_does_not_match_global_rank"
    )
    global_rank: int
    tensor_parallel_rank: int
    host: str


Finding = Annotated[
    Union[
        ParticipantCountMismatch,
        DuplicatedRank,
        RankOutOfRange,
        ParticipantOnUnselectedHost,
        SelectedHostCarriedNoRank,
        SelectedHostNamedMoreThanOnce,
        RanksShareHostLocalWorkerProcessKey,
        ParticipantFromAnotherIncarnation,
        ObservationIncomplete,
        NotATensorParallelDecomposition,
        DecompositionInconsistentWithWorldSize,
        TensorParallelRankDoesNotMatchGlobalRank,
    ],
    Field(discriminator="kind"),
]

FINDING_KINDS: tuple[str, ...] = tuple(
    cls.model_fields["kind"].default for cls in get_args(get_args(Finding)[0])
)
"""Every finding kind, in the order a decision lists them."""

# --------------------------------------------------------------------- decision


class RankPopulationDecision(BaseModel):
    """``coherent`` with no findings, or ``refused`` with every finding."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decision: Literal["coherent", "refused"]
    findings: tuple[Finding, ...]

    @model_validator(mode="after")
    def _decision_matches_findings(self) -> "RankPopulationDecision":
        if (self.decision == "coherent") != (not self.findings):
            raise ValueError("a coherent decision carries no findings; a refused one carries at least one")
        return self

    @property
    def coherent(self) -> bool:
        return self.decision == "coherent"

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(f.kind for f in self.findings)

    def to_json_dict(self) -> dict[str, Any]:
        """``{"decision": ..., "findings": [{"kind": ..., ...}]}`` with ``kind`` first."""
        return {"decision": self.decision, "findings": [f.model_dump(mode="json") for f in self.findings]}


def decide_rank_population(observation: DeclaredObservation) -> RankPopulationDecision:
    """Decide a declared observation; every check runs, every finding is kept (in the order of the checks)."""
    findings = (_rank_set_findings(observation) + _host_findings(observation) + _process_findings(observation)
                + _decomposition_findings(observation))
    if findings:
        return RankPopulationDecision(decision="refused", findings=tuple(findings))
    return RankPopulationDecision(decision="coherent", findings=())


def _rank_set_findings(obs: DeclaredObservation) -> list[Any]:
    """The rank set: count, uniqueness and range together pin it (see the module docstring)."""
    parts = obs.participants
    findings: list[Any] = []
    if len(parts) != obs.world_size:
        findings.append(ParticipantCountMismatch(world_size=obs.world_size, participant_count=len(parts)))

    hosts_by_rank: dict[int, list[str]] = defaultdict(list)
    for p in parts:
        hosts_by_rank[p.global_rank].append(p.host)
    for rank, hosts in sorted(hosts_by_rank.items()):
        if len(hosts) > 1:
            findings.append(DuplicatedRank(global_rank=rank, occurrences=len(hosts), hosts=tuple(sorted(hosts))))

    for p in _by_location(parts):
        if not 0 <= p.global_rank < obs.world_size:
            findings.append(RankOutOfRange(global_rank=p.global_rank, host=p.host, world_size=obs.world_size))
    return findings


def _host_findings(obs: DeclaredObservation) -> list[Any]:
    """The host join, in both directions, over distinct host identities."""
    parts = obs.participants
    findings: list[Any] = []
    selected = set(obs.selected_hosts)
    carrying = {p.host for p in parts}
    for p in _by_location(parts):
        if p.host not in selected:
            findings.append(ParticipantOnUnselectedHost(global_rank=p.global_rank, host=p.host))
    for host in sorted(selected - carrying):
        findings.append(SelectedHostCarriedNoRank(host=host))
    for host, n in sorted(Counter(obs.selected_hosts).items()):
        if n > 1:
            findings.append(SelectedHostNamedMoreThanOnce(host=host, occurrences=n))
    return findings


def _process_findings(obs: DeclaredObservation) -> list[Any]:
    """Worker processes (their keys are host-local: compared within one host), incarnations, completeness."""
    parts = obs.participants
    findings: list[Any] = []
    ranks_by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
    for p in parts:
        ranks_by_key[(p.host, p.host_local_worker_process_key)].append(p.global_rank)
    for (host, key), ranks in sorted(ranks_by_key.items()):
        if len(ranks) > 1:
            findings.append(
                RanksShareHostLocalWorkerProcessKey(host=host, process_key=key, global_ranks=tuple(sorted(ranks)))
            )

    for p in _by_location(parts):
        if p.incarnation != obs.incarnation:
            findings.append(
                ParticipantFromAnotherIncarnation(
                    global_rank=p.global_rank,
                    host=p.host,
                    participant_incarnation=p.incarnation,
                    observation_incarnation=obs.incarnation,
                )
            )

    if not obs.returned_completely:
        findings.append(ObservationIncomplete(participant_count=len(parts)))
    return findings


def _decomposition_findings(obs: DeclaredObservation) -> list[Any]:
    """The decomposition: only a pure tensor-parallel world is in this law's scope."""
    parts = obs.participants
    findings: list[Any] = []
    tp, pp, dp = obs.tensor_parallel_size, obs.pipeline_parallel_size, obs.data_parallel_size
    if pp != 1 or dp != 1:
        findings.append(
            NotATensorParallelDecomposition(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
        )
    if tp * pp * dp != obs.world_size:
        findings.append(
            DecompositionInconsistentWithWorldSize(
                world_size=obs.world_size,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                data_parallel_size=dp,
                product=tp * pp * dp,
            )
        )

    # In a pure TP world the TP rank *is* the global rank; this one equality also
    # covers TP ranks out of range or repeated, given the global-rank checks.
    # It is the law of a pure TP world only: where PP or DP exceeds 1 the world is
    # already refused as not a TP decomposition, the premise of the equality does
    # not hold (TP ranks repeat across stages by design), and a mismatch would
    # restate that one finding once per rank.
    pure_tensor_parallel = pp == 1 and dp == 1
    for p in _by_location(parts) if pure_tensor_parallel else ():
        if p.tensor_parallel_rank != p.global_rank:
            findings.append(
                TensorParallelRankDoesNotMatchGlobalRank(
                    global_rank=p.global_rank, tensor_parallel_rank=p.tensor_parallel_rank, host=p.host
                )
            )
    return findings


def _by_location(parts: tuple[Participant, ...]) -> list[Participant]:
    """Participants in a stable order that does not depend on list order."""
    return sorted(
        parts,
        key=lambda p: (p.global_rank, p.host, p.host_local_worker_process_key, p.tensor_parallel_rank, p.incarnation),
    )
