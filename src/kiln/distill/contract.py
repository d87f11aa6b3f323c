"""Autodistill v1 artifact models: plan, capture-token row, shard manifest,
consumption event and tokenized teacher example (their building blocks, the
schema IDs, limits, field types and fingerprint/policy models, are in
:mod:`kiln.distill.contract_types`).

Every model is frozen, strict (no type coercion), rejects unknown fields and
carries an exact ``schema`` discriminator (Python attribute ``schema_id``).
All fields are required: optional values are written as explicit ``null`` so
that the canonical JSON, and therefore every hash, is fully determined.

Parse untrusted bytes with ``Model.parse(data)``: it rejects duplicate keys and
non-finite numbers, names an unknown major version as such, and raises
``ContractError`` with the failing field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from kiln.canonical import CanonicalJSONError, strict_json_loads
from kiln.distill import estimate as _estimate
from kiln.distill.contract_types import (
    CAPTURE_TOKEN_SCHEMA,
    CONSUMPTION_EVENT_SCHEMA,
    CaptureSettings,
    ConsumptionPolicy,
    ConsumptionState,
    ContractModel,
    Count,
    DatasetFingerprint,
    Estimate,
    FileDigest,
    MAX_ARTIFACT_JSON_BYTES,
    MAX_COUNT,
    MAX_PAYLOADS,
    MAX_SEQUENCE_TOKENS,
    ModelFingerprint,
    Number,
    PLAN_SCHEMA,
    PortableId,
    ProbabilityPolicy,
    SCHEMA_PREFIX,
    SCHEMA_RE,
    SHARD_MANIFEST_SCHEMA,
    Sha256,
    ShardState,
    TOKENIZED_TEACHER_EXAMPLE_SCHEMA,
    ThroughputProfile,
    TokenId,
    TokenizerFingerprint,
    Trajectory,
    check_schema,
    check_sorted_unique,
)
from kiln.distill.errors import ContractError, DistillError, EstimateError, UnknownSchemaError
from kiln.distill.paths import check_relative_path
from kiln.distill.probability import check_row_probabilities

__all__ = [
    "PLAN_SCHEMA",
    "CAPTURE_TOKEN_SCHEMA",
    "SHARD_MANIFEST_SCHEMA",
    "CONSUMPTION_EVENT_SCHEMA",
    "TOKENIZED_TEACHER_EXAMPLE_SCHEMA",
    "SCHEMA_PREFIX",
    "MAX_ARTIFACT_JSON_BYTES",
    "MAX_SEQUENCE_TOKENS",
    "MAX_PAYLOADS",
    "FileDigest",
    "ModelFingerprint",
    "TokenizerFingerprint",
    "DatasetFingerprint",
    "CaptureSettings",
    "ProbabilityPolicy",
    "ConsumptionPolicy",
    "ThroughputProfile",
    "Estimate",
    "Plan",
    "CaptureTokenRow",
    "TokenizedTeacherExample",
    "PayloadCommitment",
    "ShardManifest",
    "ConsumptionEvent",
    "plan_sha256",
    "complete_plan",
    "expected_estimate",
    "parse_artifact",
    "Trajectory",
    "ShardState",
    "ConsumptionState",
]

# ------------------------------------------------------------------------- plan


class Plan(ContractModel):
    SCHEMA: ClassVar[str] = PLAN_SCHEMA

    schema_id: Literal["soup.autodistill.plan.v1"] = Field(alias="schema")
    run_id: PortableId
    teacher: ModelFingerprint
    student: ModelFingerprint
    tokenizer: TokenizerFingerprint
    dataset: DatasetFingerprint
    capture: CaptureSettings
    probability: ProbabilityPolicy
    consumption: ConsumptionPolicy
    throughput_profile: Optional[ThroughputProfile]
    throughput_profile_sha256: Optional[Sha256]
    estimate: Estimate

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        if self.probability.top_k > self.tokenizer.vocab_size:
            raise ValueError(f"top_k {self.probability.top_k} exceeds vocab_size {self.tokenizer.vocab_size}")
        prof = self.throughput_profile
        if (prof is None) != (self.throughput_profile_sha256 is None):
            raise ValueError("throughput_profile and throughput_profile_sha256 come together or not at all")
        if prof is not None:
            if prof.digest() != self.throughput_profile_sha256:
                raise ValueError("throughput_profile_sha256 does not match the profile's canonical hash")
            _check_profile_compatible(self, prof)
        if self.estimate.to_obj() != expected_estimate(self):
            raise ValueError("estimate does not equal the estimate recomputed from the plan (tampered?)")
        return self


def _check_profile_compatible(plan: Plan, prof: ThroughputProfile) -> None:
    cap = plan.capture
    mismatches = [
        name
        for name, ok in (
            ("backend", prof.backend == cap.backend),
            ("dtype", prof.dtype == cap.dtype),
            ("quantization", prof.quantization == cap.quantization),
            ("teacher_fingerprint_sha256", prof.teacher_fingerprint_sha256 == plan.teacher.digest()),
            (
                "sequence length band",
                prof.sequence_length_min <= cap.max_sequence_length <= prof.sequence_length_max,
            ),
        )
        if not ok
    ]
    if mismatches:
        raise ValueError(f"throughput profile is not compatible with this capture: {', '.join(mismatches)}")


def _estimate_inputs(plan_obj: dict[str, Any]) -> dict[str, Any]:
    cap, prob, prof = plan_obj["capture"], plan_obj["probability"], plan_obj["throughput_profile"]
    return {
        "tokens": cap["planned_tokens"],
        "vocab_size": plan_obj["tokenizer"]["vocab_size"],
        "top_k": prob["top_k"],
        "max_forced": cap["max_forced_ids"],
        "id_bytes": prob["id_bytes"],
        "logprob_bytes": prob["logprob_bytes"],
        "tail_bytes": prob["tail_bytes"],
        "entropy_bytes": prob["entropy_bytes"],
        "throughput_min": prof["tokens_per_second_min"] if prof else None,
        "throughput_max": prof["tokens_per_second_max"] if prof else None,
    }


def expected_estimate(plan: Plan) -> dict[str, Any]:
    """The estimate a plan must carry, recomputed from its own fields."""
    return _estimate.estimate_numbers(**_estimate_inputs(plan.model_dump(mode="json", by_alias=True)))


def complete_plan(config: dict[str, Any]) -> Plan:
    """Build a plan from every field except the derived ``estimate`` (and ``schema``).

    A config that already carries an estimate must carry exactly the computed one.
    Malformed inputs fall through to ``Plan.parse`` so its error names the field.
    """
    if not isinstance(config, dict):
        raise ContractError("plan config must be a JSON object")
    obj = dict(config)
    obj.setdefault("schema", PLAN_SCHEMA)
    given = obj.get("estimate")
    try:
        computed = _estimate.estimate_numbers(**_estimate_inputs(obj))
    except (KeyError, TypeError, AttributeError, DistillError):
        computed = None
    if computed is not None:
        if given is not None and given != computed:
            raise EstimateError("the config's estimate differs from the one computed from its fields")
        obj["estimate"] = computed
    elif given is None:
        # A well-typed placeholder so the refusal names the real cause: a malformed
        # field, or the plan validator's own recomputation error (e.g. a throughput
        # so small that seconds_max would be Infinity), never "estimate missing".
        obj["estimate"] = _ESTIMATE_PLACEHOLDER
    return Plan.parse(obj)


_ESTIMATE_PLACEHOLDER = {
    "dense_bytes": 0,
    "sparse_ids_max": 0,
    "sparse_upper_bytes": 0,
    "seconds_min": None,
    "seconds_max": None,
    "excludes_metadata": True,
}


def plan_sha256(plan: Plan) -> str:
    """SHA-256 of the plan's canonical JSON: the run identity embedded in every shard."""
    return plan.digest()


# ------------------------------------------------------------------------- rows

TokenIds = Annotated[tuple[TokenId, ...], Field(max_length=MAX_SEQUENCE_TOKENS)]


class TokenizedTeacherExample(ContractModel):
    """One dataset row: already tokenized prompt and teacher target IDs."""

    SCHEMA: ClassVar[str] = TOKENIZED_TEACHER_EXAMPLE_SCHEMA

    schema_id: Literal["soup.autodistill.tokenized-teacher-example.v1"] = Field(alias="schema")
    example_id: PortableId
    prompt_token_ids: Annotated[TokenIds, Field(min_length=1)]
    target_token_ids: Annotated[TokenIds, Field(min_length=1)]


class CaptureTokenRow(ContractModel):
    """Teacher probabilities at one position of one trajectory.

    ``target_token_id`` is set on teacher-expert rows, ``sampled_token_id`` on
    student-rollout rows (the other is ``null``); that ID must be forced into S.
    """

    SCHEMA: ClassVar[str] = CAPTURE_TOKEN_SCHEMA

    schema_id: Literal["soup.autodistill.capture-token.v1"] = Field(alias="schema")
    example_id: PortableId
    trajectory: Trajectory
    position: Annotated[int, Field(ge=0, lt=MAX_SEQUENCE_TOKENS)]
    vocab_size: Annotated[int, Field(ge=1, le=_estimate.MAX_VOCAB_SIZE)]
    context_token_ids: Annotated[TokenIds, Field(min_length=1)]
    target_token_id: Optional[TokenId]
    sampled_token_id: Optional[TokenId]
    top_k_ids: Annotated[TokenIds, Field(min_length=1)]
    forced_ids: Annotated[TokenIds, Field(min_length=1, max_length=_estimate.MAX_FORCED_IDS)]
    selected_ids: Annotated[TokenIds, Field(min_length=1)]
    selected_logprobs: Annotated[tuple[Number, ...], Field(min_length=1, max_length=MAX_SEQUENCE_TOKENS)]
    tail_mass: Number
    entropy: Number
    temperature: Number

    @model_validator(mode="after")
    def _semantics(self) -> "CaptureTokenRow":
        if self.trajectory == "teacher-expert":
            forced, other = self.target_token_id, self.sampled_token_id
            want, stray = "target_token_id", "sampled_token_id"
        else:
            forced, other = self.sampled_token_id, self.target_token_id
            want, stray = "sampled_token_id", "target_token_id"
        if forced is None or other is not None:
            raise ValueError(f"{self.trajectory} rows set {want} and leave {stray} null")
        if forced not in self.forced_ids:
            raise ValueError(f"{want} {forced} must be one of forced_ids")
        if any(t >= self.vocab_size for t in self.context_token_ids):
            raise ValueError("context_token_ids hold an ID outside the vocabulary")
        check_row_probabilities(
            vocab_size=self.vocab_size,
            top_k_ids=self.top_k_ids,
            forced_ids=self.forced_ids,
            selected_ids=self.selected_ids,
            selected_logprobs=self.selected_logprobs,
            tail_mass=self.tail_mass,
            entropy=self.entropy,
            temperature=self.temperature,
        )
        return self

    @property
    def forced_token_id(self) -> int:
        """The trajectory's own next token: the teacher target or the student sample."""
        return self.target_token_id if self.trajectory == "teacher-expert" else self.sampled_token_id  # type: ignore[return-value]


# ---------------------------------------------------------------------- shards


class PayloadCommitment(ContractModel):
    path: str
    bytes: Annotated[int, Field(ge=1)]
    rows: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _safe(cls, v: str) -> str:
        try:
            return check_relative_path(v)
        except DistillError as exc:
            raise ValueError(str(exc)) from exc


class ShardManifest(ContractModel):
    """One state of one shard transaction; states chain by predecessor hash."""

    SCHEMA: ClassVar[str] = SHARD_MANIFEST_SCHEMA

    schema_id: Literal["soup.autodistill.shard-manifest.v1"] = Field(alias="schema")
    shard_id: PortableId
    transaction_id: PortableId
    state: ShardState
    plan_sha256: Sha256
    tokenizer_sha256: Sha256
    dataset_sha256: Sha256
    previous_manifest_sha256: Optional[Sha256]
    rows: Count
    tokens: Count
    payloads: Annotated[tuple[PayloadCommitment, ...], Field(max_length=MAX_PAYLOADS)]
    quarantine_reason: Optional[Annotated[str, Field(min_length=1, max_length=1024)]]

    @model_validator(mode="after")
    def _consistent(self) -> "ShardManifest":
        if self.state == "staging":
            if self.previous_manifest_sha256 is not None:
                raise ValueError("a staging manifest has no predecessor")
            if self.payloads:
                raise ValueError("a staging manifest commits no payloads yet")
        elif self.previous_manifest_sha256 is None:
            raise ValueError(f"a {self.state} manifest must name its predecessor's hash")
        if self.state in ("complete", "verified", "available") and not self.payloads:
            raise ValueError(f"a {self.state} manifest needs at least one payload")
        if (self.state == "quarantined") != (self.quarantine_reason is not None):
            raise ValueError("quarantine_reason is required for, and only for, the quarantined state")
        check_sorted_unique("payloads", [p.path for p in self.payloads])
        if self.rows != sum(p.rows for p in self.payloads) or self.tokens != sum(p.tokens for p in self.payloads):
            raise ValueError("rows/tokens must equal the sums over payloads")
        return self


# --------------------------------------------------------------- consumption


class ConsumptionEvent(ContractModel):
    """One append-only ledger entry moving an artifact view between states.

    available->reserved (reserve), reserved->available (release),
    reserved->committed (commit, with the durable checkpoint SHA-256), and a
    replay: a reservation whose ``replay_of`` is the prior commit event's hash.
    A replay normally starts from ``committed``; after a released replay the
    view is ``available`` again but still has a commit in its history, so the
    next reservation must again be a replay (the ledger checks that, since it
    needs the history). Locally: ``replay_of`` appears only on a step to
    ``reserved`` and is required on committed->reserved.
    """

    SCHEMA: ClassVar[str] = CONSUMPTION_EVENT_SCHEMA

    schema_id: Literal["soup.autodistill.consumption-event.v1"] = Field(alias="schema")
    artifact_sha256: Sha256
    view: Trajectory
    sequence: Count
    prior_state: ConsumptionState
    next_state: ConsumptionState
    run_id: PortableId
    reservation_id: PortableId
    checkpoint_sha256: Optional[Sha256]
    replay_of: Optional[Sha256]

    @model_validator(mode="after")
    def _local_rules(self) -> "ConsumptionEvent":
        committing = self.next_state == "committed"
        if committing and self.checkpoint_sha256 is None:
            raise ValueError("a commit requires the durable student checkpoint_sha256")
        if not committing and self.checkpoint_sha256 is not None:
            raise ValueError("only a commit carries checkpoint_sha256")
        if self.replay_of is not None and self.next_state != "reserved":
            raise ValueError("replay_of belongs only on a reservation (a step to 'reserved')")
        if self.prior_state == "committed" and self.next_state == "reserved" and self.replay_of is None:
            raise ValueError("a committed->reserved step is a replay and needs replay_of (the prior commit's hash)")
        return self

    @property
    def action(self) -> str:
        if self.next_state == "reserved" and self.prior_state in ("available", "committed"):
            return "replay" if self.replay_of is not None else "reserve"
        return {
            ("reserved", "available"): "release",
            ("reserved", "committed"): "commit",
        }.get((self.prior_state, self.next_state), "invalid")


_BY_SCHEMA: dict[str, type[ContractModel]] = {
    m.SCHEMA: m  # type: ignore[attr-defined]
    for m in (Plan, CaptureTokenRow, ShardManifest, ConsumptionEvent, TokenizedTeacherExample)
}


def parse_artifact(data: bytes | str | dict[str, Any]) -> ContractModel:
    """Dispatch on the ``schema`` discriminator; unknown kinds/major versions refuse."""
    obj = data
    if isinstance(data, (bytes, str)):
        if len(data) > MAX_ARTIFACT_JSON_BYTES:
            raise ContractError(f"document exceeds {MAX_ARTIFACT_JSON_BYTES} bytes")
        try:
            obj = strict_json_loads(data)
        except CanonicalJSONError as exc:
            raise ContractError(str(exc)) from exc
    if not isinstance(obj, dict):
        raise ContractError("artifact must be a JSON object")
    found = obj.get("schema")
    if found in _BY_SCHEMA:
        return _BY_SCHEMA[found].parse(obj)
    m = SCHEMA_RE.fullmatch(found) if isinstance(found, str) else None
    for known in _BY_SCHEMA:
        if m and SCHEMA_RE.fullmatch(known).group(1) == m.group(1):  # type: ignore[union-attr]
            check_schema(found, known)
    raise UnknownSchemaError(f"unknown artifact schema {str(found)[:100]!r}")
