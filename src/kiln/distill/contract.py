"""Autodistill v1 artifact models: plan, capture-token row, shard manifest,
consumption event and tokenized teacher example.

Every model is frozen, strict (no type coercion), rejects unknown fields and
carries an exact ``schema`` discriminator (Python attribute ``schema_id``).
All fields are required: optional values are written as explicit ``null`` so
that the canonical JSON, and therefore every hash, is fully determined.

Parse untrusted bytes with ``Model.parse(data)``: it rejects duplicate keys and
non-finite numbers, names an unknown major version as such, and raises
``ContractError`` with the failing field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.canonical import (
    JSONL_C14N_ALGORITHM,
    CanonicalJSONError,
    canonical_json_bytes,
    sha256_hex,
    strict_json_loads,
)
from kiln.distill import estimate as _estimate
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

SCHEMA_PREFIX = "soup.autodistill."
PLAN_SCHEMA = "soup.autodistill.plan.v1"
CAPTURE_TOKEN_SCHEMA = "soup.autodistill.capture-token.v1"
SHARD_MANIFEST_SCHEMA = "soup.autodistill.shard-manifest.v1"
CONSUMPTION_EVENT_SCHEMA = "soup.autodistill.consumption-event.v1"
TOKENIZED_TEACHER_EXAMPLE_SCHEMA = "soup.autodistill.tokenized-teacher-example.v1"

MAX_ARTIFACT_JSON_BYTES = 8 << 20  # one plan/manifest/event document
MAX_SEQUENCE_TOKENS = 1 << 20  # prompt, target or context IDs in one row
MAX_FILES_PER_FINGERPRINT = 4096
MAX_PAYLOADS = 4096
MAX_COUNT = 10**15  # rows, tokens and ledger sequences; byte counts have no ceiling

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Revision = Annotated[str, Field(pattern=r"^[0-9a-f]{40,64}$")]
Identifier = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,255}$")]
PortableId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
Label = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
# Byte counts are exact JSON integers (arbitrary precision): a realistic dense
# estimate (10**10 tokens x 152,064 IDs x 2 bytes) is above any fixed cap we
# could pick, and an artificial ceiling would refuse a plan the estimator made.
ByteCount = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0, lt=_estimate.MAX_VOCAB_SIZE)]
Width = Annotated[int, Field(ge=1, le=_estimate.MAX_WIDTH_BYTES)]

# JSON numbers keep the form they were received in (docs/distill.md, "Numbers"): an
# integer literal (no fraction, no exponent) stays an integer and is written back
# digit for digit; any other literal is an IEEE-754 double, written back as Python's
# shortest round-trip repr (1.0, 1e0 and 1.00 are all "1.0"; 1 stays "1"). Digests are
# therefore SHA-256 of the canonical bytes of the document as received: a model never
# rewrites 1 as 1.0. Integers in a number field are capped at 2^53 (beyond that an
# integer is no longer exactly a double, which the float arithmetic downstream uses).
MAX_EXACT_INT = 1 << 53
Number = Union[Annotated[int, Field(ge=-MAX_EXACT_INT, le=MAX_EXACT_INT)], float]
PositiveNumber = Union[Annotated[int, Field(gt=0, le=MAX_EXACT_INT)], Annotated[float, Field(gt=0)]]
NonNegativeNumber = Union[Annotated[int, Field(ge=0, le=MAX_EXACT_INT)], Annotated[float, Field(ge=0)]]

Trajectory = Literal["teacher-expert", "student-rollout"]
ShardState = Literal["staging", "complete", "verified", "available", "quarantined"]
ConsumptionState = Literal["available", "reserved", "committed"]

_SCHEMA_RE = re.compile(r"^soup\.autodistill\.([a-z0-9-]+)\.v([0-9]+)$")


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    def to_obj(self) -> dict[str, Any]:
        """JSON-ready dict with the ``schema`` key spelled as on the wire."""
        return self.model_dump(mode="json", by_alias=True)

    def canonical_bytes(self) -> bytes:
        return canonical_json_bytes(self.to_obj())

    def digest(self) -> str:
        """SHA-256 of this document's canonical JSON bytes."""
        return sha256_hex(self.canonical_bytes())

    @classmethod
    def parse(cls, data: bytes | str | dict[str, Any]):
        """Validate untrusted JSON (bytes/str) or an already parsed object."""
        if isinstance(data, (bytes, str)):
            if len(data) > MAX_ARTIFACT_JSON_BYTES:
                raise ContractError(f"{cls.__name__} document exceeds {MAX_ARTIFACT_JSON_BYTES} bytes")
            try:
                data = strict_json_loads(data)
            except CanonicalJSONError as exc:
                raise ContractError(f"{cls.__name__}: {exc}") from exc
        if not isinstance(data, dict):
            raise ContractError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
        expected = getattr(cls, "SCHEMA", None)
        if expected is not None:
            _check_schema(data.get("schema"), expected)
        try:
            # Round-trip through canonical JSON so strict validation sees JSON
            # arrays (accepted for tuples) exactly as a file reader would.
            received = canonical_json_bytes(data)
            model = cls.model_validate_json(received)
        except CanonicalJSONError as exc:
            raise ContractError(f"{cls.__name__}: {exc}") from exc
        except ValidationError as exc:
            raise ContractError(f"{cls.__name__} is invalid: {_describe(exc)}") from exc
        # The digest is SHA-256 of the canonical bytes of the document as received:
        # validation must not have rewritten any value (e.g. 1 into 1.0).
        if model.canonical_bytes() != received:
            raise ContractError(
                f"{cls.__name__}: validation changed the document's canonical form; this is a Kiln bug, "
                "please report it with the document"
            )
        return model


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _check_schema(found: object, expected: str) -> None:
    if found == expected:
        return
    if not isinstance(found, str):
        raise UnknownSchemaError(f"missing or non-string 'schema'; expected {expected!r}")
    m, want = _SCHEMA_RE.fullmatch(found), _SCHEMA_RE.fullmatch(expected)
    if m and want and m.group(1) == want.group(1):
        raise UnknownSchemaError(
            f"unknown major version v{m.group(2)} of {SCHEMA_PREFIX}{m.group(1)}; this reader supports "
            f"only v{want.group(2)}; upgrade Kiln or re-create the artifact"
        )
    raise UnknownSchemaError(f"schema {found[:100]!r} is not {expected!r}")


def _sorted_unique(name: str, keys: list[Any]) -> None:
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise ValueError(f"{name} must be sorted ascending with no duplicates")


# ----------------------------------------------------------------- fingerprints


class FileDigest(_Model):
    """One file bound by path (relative, normalized), exact byte size and SHA-256."""

    path: str
    size: ByteCount
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _safe(cls, v: str) -> str:
        try:
            return check_relative_path(v)
        except DistillError as exc:
            raise ValueError(str(exc)) from exc


FileList = Annotated[tuple[FileDigest, ...], Field(min_length=1, max_length=MAX_FILES_PER_FINGERPRINT)]


class ModelFingerprint(_Model):
    model_id: Identifier
    revision: Revision
    config_sha256: Sha256
    weight_files: FileList

    @field_validator("weight_files")
    @classmethod
    def _sorted(cls, v: tuple[FileDigest, ...]) -> tuple[FileDigest, ...]:
        _sorted_unique("weight_files", [f.path for f in v])
        return v


class TokenizerFingerprint(_Model):
    tokenizer_id: Identifier
    revision: Revision
    vocab_size: Annotated[int, Field(ge=1, le=_estimate.MAX_VOCAB_SIZE)]
    files: FileList
    chat_template_sha256: Sha256
    renderer_name: Label
    renderer_version: Label

    @field_validator("files")
    @classmethod
    def _sorted(cls, v: tuple[FileDigest, ...]) -> tuple[FileDigest, ...]:
        _sorted_unique("tokenizer files", [f.path for f in v])
        return v


class DatasetFingerprint(_Model):
    """Ordered source files (order is meaningful), row count and normalized hash."""

    files: FileList
    rows: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    normalization: Literal["soup-jsonl-c14n-v1"]
    normalized_sha256: Sha256

    @field_validator("files")
    @classmethod
    def _unique(cls, v: tuple[FileDigest, ...]) -> tuple[FileDigest, ...]:
        if len({f.path for f in v}) != len(v):
            raise ValueError("dataset files list one path twice")
        return v


assert JSONL_C14N_ALGORITHM == "soup-jsonl-c14n-v1"


class CaptureSettings(_Model):
    backend: Label
    backend_version: Label
    dtype: Label
    quantization: Label
    max_sequence_length: Annotated[int, Field(ge=2, le=MAX_SEQUENCE_TOKENS)]
    truncation: Literal["left", "right"]
    planned_tokens: Annotated[int, Field(ge=1, le=_estimate.MAX_PLANNED_TOKENS)]
    max_forced_ids: Annotated[int, Field(ge=1, le=_estimate.MAX_FORCED_IDS)]


class ProbabilityPolicy(_Model):
    top_k: Annotated[int, Field(ge=1, le=_estimate.MAX_TOP_K)]
    temperature: PositiveNumber
    renormalize_selected: Literal[False]
    id_bytes: Width
    logprob_bytes: Width
    tail_bytes: Width
    entropy_bytes: Width


class ConsumptionPolicy(_Model):
    """How the student may consume the artifact.

    ``rollout_checkpoint_sha256`` names the exact student checkpoint that sampled
    student-rollout prefixes (required there, ``null`` for teacher-expert).
    Student rollouts are consume-once, so their replay must be ``forbidden``.
    """

    trajectory: Trajectory
    replay: Literal["forbidden", "chained"]
    rollout_checkpoint_sha256: Optional[Sha256]

    @model_validator(mode="after")
    def _rollout_rules(self) -> "ConsumptionPolicy":
        if self.trajectory == "student-rollout":
            if self.replay != "forbidden":
                raise ValueError("student-rollout artifacts are consume-once: replay must be 'forbidden'")
            if self.rollout_checkpoint_sha256 is None:
                raise ValueError("student-rollout needs rollout_checkpoint_sha256 (the student that sampled)")
        elif self.rollout_checkpoint_sha256 is not None:
            raise ValueError("rollout_checkpoint_sha256 applies only to student-rollout artifacts")
        return self


class ThroughputProfile(_Model):
    """A previously measured end-to-end capture throughput range and its context."""

    backend: Label
    teacher_fingerprint_sha256: Sha256
    dtype: Label
    quantization: Label
    sequence_length_min: Annotated[int, Field(ge=1, le=MAX_SEQUENCE_TOKENS)]
    sequence_length_max: Annotated[int, Field(ge=1, le=MAX_SEQUENCE_TOKENS)]
    hardware_class: Label
    tokens_per_second_min: PositiveNumber
    tokens_per_second_max: PositiveNumber

    @model_validator(mode="after")
    def _ranges(self) -> "ThroughputProfile":
        if self.sequence_length_min > self.sequence_length_max:
            raise ValueError("sequence_length_min exceeds sequence_length_max")
        if self.tokens_per_second_min > self.tokens_per_second_max:
            raise ValueError("tokens_per_second_min exceeds tokens_per_second_max")
        return self


class Estimate(_Model):
    dense_bytes: ByteCount
    sparse_ids_max: Count
    sparse_upper_bytes: ByteCount
    seconds_min: Optional[NonNegativeNumber]
    seconds_max: Optional[NonNegativeNumber]
    excludes_metadata: Literal[True]


# ------------------------------------------------------------------------- plan


class Plan(_Model):
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


class TokenizedTeacherExample(_Model):
    """One dataset row: already tokenized prompt and teacher target IDs."""

    SCHEMA: ClassVar[str] = TOKENIZED_TEACHER_EXAMPLE_SCHEMA

    schema_id: Literal["soup.autodistill.tokenized-teacher-example.v1"] = Field(alias="schema")
    example_id: PortableId
    prompt_token_ids: Annotated[TokenIds, Field(min_length=1)]
    target_token_ids: Annotated[TokenIds, Field(min_length=1)]


class CaptureTokenRow(_Model):
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


class PayloadCommitment(_Model):
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


class ShardManifest(_Model):
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
        _sorted_unique("payloads", [p.path for p in self.payloads])
        if self.rows != sum(p.rows for p in self.payloads) or self.tokens != sum(p.tokens for p in self.payloads):
            raise ValueError("rows/tokens must equal the sums over payloads")
        return self


# --------------------------------------------------------------- consumption


class ConsumptionEvent(_Model):
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


_BY_SCHEMA: dict[str, type[_Model]] = {
    m.SCHEMA: m  # type: ignore[attr-defined]
    for m in (Plan, CaptureTokenRow, ShardManifest, ConsumptionEvent, TokenizedTeacherExample)
}


def parse_artifact(data: bytes | str | dict[str, Any]) -> _Model:
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
    m = _SCHEMA_RE.fullmatch(found) if isinstance(found, str) else None
    for known in _BY_SCHEMA:
        if m and _SCHEMA_RE.fullmatch(known).group(1) == m.group(1):  # type: ignore[union-attr]
            _check_schema(found, known)
    raise UnknownSchemaError(f"unknown artifact schema {str(found)[:100]!r}")
