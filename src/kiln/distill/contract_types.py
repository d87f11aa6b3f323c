"""Autodistill v1 contract building blocks: schema IDs, limits, field types, the strict base model and the
fingerprint and policy models a plan is made of (:mod:`kiln.distill.contract` holds the artifacts).

Every model is frozen, strict (no type coercion), rejects unknown fields and carries an exact ``schema``
discriminator where it is a document of its own. Pure: no torch.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.canonical import (
    JSONL_C14N_ALGORITHM,
    CanonicalJSONError,
    canonical_json_bytes,
    sha256_hex,
    strict_json_loads,
)
from kiln.distill import estimate as _estimate
from kiln.distill.errors import ContractError, DistillError, UnknownSchemaError
from kiln.distill.paths import check_relative_path


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

SCHEMA_RE = re.compile(r"^soup\.autodistill\.([a-z0-9-]+)\.v([0-9]+)$")


class ContractModel(BaseModel):
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
            check_schema(data.get("schema"), expected)
        try:
            # Round-trip through canonical JSON so strict validation sees JSON
            # arrays (accepted for tuples) exactly as a file reader would.
            received = canonical_json_bytes(data)
            model = cls.model_validate_json(received)
        except CanonicalJSONError as exc:
            raise ContractError(f"{cls.__name__}: {exc}") from exc
        except ValidationError as exc:
            raise ContractError(f"{cls.__name__} is invalid: {describe_validation_error(exc)}") from exc
        # The digest is SHA-256 of the canonical bytes of the document as received:
        # validation must not have rewritten any value (e.g. 1 into 1.0).
        if model.canonical_bytes() != received:
            raise ContractError(
                f"{cls.__name__}: validation changed the document's canonical form; this is a Kiln bug, "
                "please report it with the document"
            )
        return model


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def check_schema(found: object, expected: str) -> None:
    if found == expected:
        return
    if not isinstance(found, str):
        raise UnknownSchemaError(f"missing or non-string 'schema'; expected {expected!r}")
    m, want = SCHEMA_RE.fullmatch(found), SCHEMA_RE.fullmatch(expected)
    if m and want and m.group(1) == want.group(1):
        raise UnknownSchemaError(
            f"unknown major version v{m.group(2)} of {SCHEMA_PREFIX}{m.group(1)}; this reader supports "
            f"only v{want.group(2)}; upgrade Kiln or re-create the artifact"
        )
    raise UnknownSchemaError(f"schema {found[:100]!r} is not {expected!r}")


def check_sorted_unique(name: str, keys: list[Any]) -> None:
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise ValueError(f"{name} must be sorted ascending with no duplicates")


# ----------------------------------------------------------------- fingerprints


class FileDigest(ContractModel):
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


class ModelFingerprint(ContractModel):
    model_id: Identifier
    revision: Revision
    config_sha256: Sha256
    weight_files: FileList

    @field_validator("weight_files")
    @classmethod
    def _sorted(cls, v: tuple[FileDigest, ...]) -> tuple[FileDigest, ...]:
        check_sorted_unique("weight_files", [f.path for f in v])
        return v


class TokenizerFingerprint(ContractModel):
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
        check_sorted_unique("tokenizer files", [f.path for f in v])
        return v


class DatasetFingerprint(ContractModel):
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


class CaptureSettings(ContractModel):
    backend: Label
    backend_version: Label
    dtype: Label
    quantization: Label
    max_sequence_length: Annotated[int, Field(ge=2, le=MAX_SEQUENCE_TOKENS)]
    truncation: Literal["left", "right"]
    planned_tokens: Annotated[int, Field(ge=1, le=_estimate.MAX_PLANNED_TOKENS)]
    max_forced_ids: Annotated[int, Field(ge=1, le=_estimate.MAX_FORCED_IDS)]


class ProbabilityPolicy(ContractModel):
    top_k: Annotated[int, Field(ge=1, le=_estimate.MAX_TOP_K)]
    temperature: PositiveNumber
    renormalize_selected: Literal[False]
    id_bytes: Width
    logprob_bytes: Width
    tail_bytes: Width
    entropy_bytes: Width


class ConsumptionPolicy(ContractModel):
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


class ThroughputProfile(ContractModel):
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


class Estimate(ContractModel):
    dense_bytes: ByteCount
    sparse_ids_max: Count
    sparse_upper_bytes: ByteCount
    seconds_min: Optional[NonNegativeNumber]
    seconds_max: Optional[NonNegativeNumber]
    excludes_metadata: Literal[True]
