"""Wire models for ``/v1/judgments*`` (pydantic only; no torch).

A judgment is one pairwise preference: a prompt, two responses, which one a person (or a
process) preferred, or ``tie``, with an optional rationale and author. Every field is bounded
here; the service adds the checks that need state (a judge adapter that is served, enough
judgments to train on).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from kiln.adapters.manifest import MAX_LORA_RANK
from kiln.adapter_names import NAME_RE as ADAPTER_NAME_RE
from kiln.adapter_names import NAME_SCHEMA
from kiln.training.schemas import LocalityRequest
from kiln.wire_rules import NOT_BLANK_SCHEMA

MAX_PROMPT_CHARS = 16_384
MAX_RESPONSE_CHARS = 16_384
MAX_RATIONALE_CHARS = 4_096
MAX_AUTHOR_CHARS = 128
MAX_PAGE = 500
MAX_TRAIN_JUDGMENTS = 500  # both orders of each: the SFT job's inline limit of 1,000 examples
JUDGMENT_ID_RE = re.compile(r"^jdg-[0-9a-f]{16}$")
AUTHOR_RE = re.compile(r"^[A-Za-z0-9@._:+ -]{1,128}$")


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must contain a non-whitespace character")
    return v


class JudgmentCreate(_Wire):
    """One A/B preference as a client records it."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="what both responses answer",
                        json_schema_extra=NOT_BLANK_SCHEMA)
    response_a: str = Field(min_length=1, max_length=MAX_RESPONSE_CHARS, json_schema_extra=NOT_BLANK_SCHEMA)
    response_b: str = Field(min_length=1, max_length=MAX_RESPONSE_CHARS, json_schema_extra=NOT_BLANK_SCHEMA)
    preferred: Literal["a", "b", "tie"] = Field(description="the better response, or tie")
    rationale: str | None = Field(None, max_length=MAX_RATIONALE_CHARS, description="why (kept, not trained on)")
    author: str | None = Field(None, description="who judged: letters, digits, space and @._:+-, at most 128",
                               json_schema_extra={"pattern": AUTHOR_RE.pattern})

    _blank = field_validator("prompt", "response_a", "response_b")(_not_blank)

    @field_validator("author")
    @classmethod
    def _author(cls, v: str | None) -> str | None:
        if v is not None and not AUTHOR_RE.fullmatch(v):
            raise ValueError("author is 1-128 characters: letters, digits, space and @._:+-")
        return v

    @model_validator(mode="after")
    def _distinct(self) -> JudgmentCreate:
        if self.response_a == self.response_b and self.preferred != "tie":
            raise ValueError("response_a and response_b are the same text; only a tie can prefer neither")
        return self


class Judgment(BaseModel):
    """A stored judgment."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["judgment"] = "judgment"
    prompt: str
    response_a: str
    response_b: str
    preferred: Literal["a", "b", "tie"]
    rationale: str | None = None
    author: str | None = None
    created_at: float = Field(description="server time the judgment was recorded (Unix seconds)")


class JudgmentList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["list"] = "list"
    data: list[Judgment]
    has_more: bool
    last_id: str | None = Field(description="pass as `after` for the next page; null on an empty page")
    total: int = Field(description="judgments in the store")


class JudgeTrainRequest(_Wire):
    """Train a judge adapter (SFT) on the stored judgments, ties left out (docs/evals.md, "Judgments")."""

    adapter: str = Field(description="name the judge adapter is published under", json_schema_extra=NAME_SCHEMA)
    limit: int = Field(MAX_TRAIN_JUDGMENTS, ge=1, le=MAX_TRAIN_JUDGMENTS,
                       description="train on at most this many non-tie judgments, the most recent")
    epochs: int | None = Field(None, ge=1, le=1_000, description="default: until the answers are learned")
    max_steps: int | None = Field(None, ge=1, le=1_000_000)
    learning_rate: float = Field(1e-2, gt=0, le=1.0)
    lora_rank: int | None = Field(None, ge=1, le=MAX_LORA_RANK)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    auto_load: bool = Field(False, description="serve the judge once published")
    locality: LocalityRequest | None = Field(None, description="the SFT job's locality measure and guard override "
                                             "(docs/training.md, \"Locality\")")

    @field_validator("adapter")
    @classmethod
    def _name(cls, v: str) -> str:
        if not ADAPTER_NAME_RE.fullmatch(v):
            raise ValueError("adapter names are 1-64 characters: letters, digits, '.', '_', '-', starting alphanumeric")
        return v


class JudgeTrainResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["judgment.training"] = "judgment.training"
    job: dict = Field(description="the queued SFT job (follow it with GET /v1/train/jobs/{id})")
    judgments: int = Field(description="non-tie judgments trained on")
    examples: int = Field(description="SFT examples: each judgment in both orders")
    judgments_sha256: str = Field(description="digest of the judgments' IDs and contents, in training order")
    format: str = Field(description="the preference prompt format (kiln.judge-preference.v1)")


class CompareRequest(_Wire):
    """Ask a judge which of two responses is better."""

    judge: Annotated[str, StringConstraints(max_length=NAME_SCHEMA["maxLength"], pattern=NAME_SCHEMA["pattern"])] | \
        None = Field(None, description="a served judge adapter (an adapter name; 404 when it is not loaded); "
                     "omitted: the base model")
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    response_a: str = Field(min_length=1, max_length=MAX_RESPONSE_CHARS)
    response_b: str = Field(min_length=1, max_length=MAX_RESPONSE_CHARS)


class CompareResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["judgment.comparison"] = "judgment.comparison"
    judge: str | None
    judge_revision: str | None = Field(description="the judge adapter revision that scored; null: the base model")
    p_a: float = Field(description="P(response_a is better), averaged over both presentation orders")
    preferred: Literal["a", "b", "tie"] = Field(description="a when p_a > 0.5, b when p_a < 0.5")
    orders: list[float] = Field(description="P(response_a is better) as shown first, then as shown second")
