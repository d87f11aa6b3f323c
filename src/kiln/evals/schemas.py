"""Wire models for evals: suites, scorers, generation settings, run requests, the post-train gate.

Pydantic only (no torch). Every field is bounded here; checks that need more than
the request (regex compilation, JSON Schema meta-validation, whether code execution
is enabled, adapters in the store) happen in :func:`kiln.evals.scorers.validate_suite`
and :class:`kiln.evals.service.EvalService` before anything runs.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from kiln.adapter_names import NAME_RE as ADAPTER_NAME_RE
from kiln.adapter_names import NAME_SCHEMA, REVISION_SCHEMA
from kiln.runtime.chat_generation import ChatGenerationFields
from kiln.wire_rules import NOT_BLANK_SCHEMA, NOT_NULL, field_is, rules, when

MAX_EXAMPLES = 2_000
MAX_MESSAGES = 64
MAX_MESSAGE_CHARS = 32_768
MAX_REFERENCE_CHARS = 32_768
MAX_SCORERS = 8
MAX_SAMPLES = 16
MAX_EVAL_TOKENS = 32_768  # the context left after each prompt caps a sample too
MAX_PATTERN_CHARS = 1_024  # user-supplied regex
MAX_SCHEMA_BYTES = 64 * 1024  # JSON Schema of a json_schema scorer
MAX_RUBRIC_CHARS = 8_192
MAX_CHOICES = 26
MAX_COMPARE_TARGETS = 8
MAX_CODE_TIMEOUT_S = 30.0
MAX_CODE_MEMORY_MB = 2_048
SUITE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RUN_ID_RE = re.compile(r"^eval-[0-9a-f]{16}$")
REVISION_RE = re.compile(r"^[0-9a-f]{64}$")
SUITE_NAME_SCHEMA: dict[str, Any] = {"pattern": SUITE_NAME_RE.pattern, "maxLength": 64}  # published in /openapi.json
RUN_ID_SCHEMA: dict[str, Any] = {"pattern": RUN_ID_RE.pattern}


def _check_suite_name(v: str) -> str:
    if not SUITE_NAME_RE.fullmatch(v):
        raise ValueError("suite names are 1-64 characters: letters, digits, '.', '_', '-', starting alphanumeric")
    return v


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatMessage(_Wire):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_MESSAGE_CHARS)


class EvalExample(_Wire):
    """One question: the chat prompt and the reference the scorers compare against."""

    id: str | None = Field(None, max_length=128, description="stable ID used for pairing; default: the row index")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    reference: str = Field("", max_length=MAX_REFERENCE_CHARS)

    @model_validator(mode="after")
    def _prompt_last(self) -> "EvalExample":
        if self.messages[-1].role == "assistant":
            raise ValueError("an eval example's messages are the prompt: the last one must not be an assistant turn")
        return self


# -- scorers ------------------------------------------------------------------------------------
class ExactScorer(_Wire):
    type: Literal["exact"]
    strip: bool = True
    case_sensitive: bool = False
    collapse_whitespace: bool = True
    strip_punctuation: bool = False


class ContainsScorer(_Wire):
    type: Literal["contains"]
    case_sensitive: bool = False


class RegexScorer(_Wire):
    """Passes when ``pattern`` (RE2 syntax: linear time, no backreferences) matches the completion.

    ``pattern`` may contain ``{reference}``; it is replaced by the escaped reference."""

    type: Literal["regex"]
    pattern: str = Field(min_length=1, max_length=MAX_PATTERN_CHARS)
    full_match: bool = False
    case_sensitive: bool = True


class NumericScorer(_Wire):
    """Compares the last number in the completion with the reference within ``abs_tol`` or ``rel_tol``."""

    type: Literal["numeric"]
    abs_tol: float = Field(0.0, ge=0, le=1e12, allow_inf_nan=False)
    rel_tol: float = Field(0.0, ge=0, le=1e3, allow_inf_nan=False)


class JsonValidScorer(_Wire):
    type: Literal["json_valid"]


class JsonSchemaScorer(_Wire):
    """The completion parses as JSON and validates against ``json_schema`` (local ``$ref`` only)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any]


class ChoiceScorer(_Wire):
    """Multiple choice: the first standalone choice letter in the completion equals the reference letter."""

    type: Literal["choice"]
    choices: str = Field("ABCD", min_length=2, max_length=MAX_CHOICES, pattern=r"^[A-Z]+$")


class CodeScorer(_Wire):
    """Runs the completion's Python (first fenced block, else all of it) followed by the reference
    (test code) in a sandbox; passes on exit status 0. Needs ``eval.allow_code_execution = true``."""

    type: Literal["code"]
    timeout_s: float = Field(5.0, gt=0, le=MAX_CODE_TIMEOUT_S)
    memory_mb: int = Field(256, ge=32, le=MAX_CODE_MEMORY_MB)


class _AdapterFields(_Wire):
    @field_validator("adapter", check_fields=False)
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not ADAPTER_NAME_RE.fullmatch(v):
            raise ValueError("adapter names are 1-64 characters: letters, digits, '.', '_', '-'")
        return v

    @field_validator("revision", check_fields=False)
    @classmethod
    def _rev(cls, v: str | None) -> str | None:
        if v is not None and not REVISION_RE.fullmatch(v):
            raise ValueError("a revision is 64 lowercase hex characters")
        return v


class AdapterRef(_AdapterFields):
    """An adapter in the store; ``revision`` omitted: the served revision if it is active, else HEAD."""

    adapter: str = Field(json_schema_extra=NAME_SCHEMA)
    revision: str | None = Field(None, json_schema_extra=REVISION_SCHEMA)


DEFAULT_RUBRIC = (
    "You are grading an answer.\nQuestion: {question}\nReference answer: {reference}\n"
    "Candidate answer: {answer}\nReply PASS if the candidate answer is correct, else FAIL.\nVerdict:"
)


class JudgeScorer(_Wire):
    """A local model (the base, or ``judge`` adapter) grades each answer.

    ``mode = "rubric"`` (default): the first ``PASS``/``FAIL`` word of its greedy reply to ``rubric`` is
    the verdict (neither: fail, reported as unparsed). ``mode = "preference"``: a judge trained on A/B
    judgments (``POST /v1/judgments/train``) compares the answer with the example's reference from its
    logprobs of ``A`` and ``B`` in both orders; it passes when P(answer is better) >= ``threshold``."""

    type: Literal["judge"]
    judge: AdapterRef | None = Field(None, description="judge adapter; omitted: the base model")
    mode: Literal["rubric", "preference"] = Field("rubric", description="PASS/FAIL reply, or A/B preference")
    rubric: str = Field(DEFAULT_RUBRIC, min_length=1, max_length=MAX_RUBRIC_CHARS)
    max_tokens: int = Field(8, ge=1, le=256)
    threshold: float = Field(0.5, ge=0, le=1, allow_inf_nan=False,
                             description="preference mode: the least P(answer better than reference) that passes")

    @model_serializer(mode="wrap")
    def _rubric_dumps_as_before(self, handler: Any) -> Any:
        out = handler(self)  # a rubric judge dumps as before the preference mode (suite digests do not change)
        if isinstance(out, dict) and out.get("mode") == "rubric" and out.get("threshold") == 0.5:
            out.pop("mode", None)
            out.pop("threshold", None)
        return out


Scorer = Annotated[
    Union[ExactScorer, ContainsScorer, RegexScorer, NumericScorer, JsonValidScorer, JsonSchemaScorer, ChoiceScorer,
          CodeScorer, JudgeScorer],
    Field(discriminator="type"),
]


class GenerationSettings(_Wire, ChatGenerationFields):
    """A suite's sampling, and its prompts' template kwargs and thinking budget (kiln.runtime.chat_generation:
    as a chat request; the answers are split by the server's reasoning parser and scored on their content)."""

    temperature: float = Field(0.0, ge=0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1.0)
    max_tokens: int = Field(64, ge=1, le=MAX_EVAL_TOKENS, description="per sample, at most the context left "
                                                                      "after the prompt")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    samples: int = Field(1, ge=1, le=MAX_SAMPLES, description="k completions per example")
    stop: list[str] = Field(default_factory=list, max_length=8)



class SuiteSpec(_Wire):
    """A suite: examples, scorers (a sample passes when all pass), generation settings, aggregation."""

    model_config = ConfigDict(json_schema_extra=rules(
        when(field_is("aggregation", {"enum": ["pass@k", "majority@k"]}),
             field_is("generation", field_is("samples", {"minimum": 2}))),
        when(field_is("generation", field_is("samples", {"minimum": 2})),
             field_is("generation", field_is("temperature", {"exclusiveMinimum": 0})))))

    name: str = Field(json_schema_extra=SUITE_NAME_SCHEMA)
    description: str = Field("", max_length=4_096)
    examples: list[EvalExample] = Field(min_length=1, max_length=MAX_EXAMPLES)
    scorers: list[Scorer] = Field(min_length=1, max_length=MAX_SCORERS)
    generation: GenerationSettings = GenerationSettings()
    aggregation: Literal["mean", "pass@k", "majority@k"] = "mean"

    _suite_name = field_validator("name")(classmethod(lambda cls, v: _check_suite_name(v)))

    @model_validator(mode="after")
    def _ids(self) -> "SuiteSpec":
        ids = [e.id if e.id is not None else str(i) for i, e in enumerate(self.examples)]
        if len(set(ids)) != len(ids):
            raise ValueError("example ids must be unique within a suite")
        if self.aggregation != "mean" and self.generation.samples < 2:
            raise ValueError(f"aggregation {self.aggregation} needs generation.samples >= 2")
        if self.generation.samples > 1 and self.generation.temperature == 0:
            raise ValueError("several samples per example need temperature > 0 (greedy samples are identical)")
        return self

    def example_ids(self) -> list[str]:
        return [e.id if e.id is not None else str(i) for i, e in enumerate(self.examples)]


# -- run requests ---------------------------------------------------------------------------------
class Target(_AdapterFields):
    """What is evaluated: the base model (``adapter`` omitted) or an adapter at a revision."""

    model_config = ConfigDict(json_schema_extra=rules(when(field_is("revision", NOT_NULL), field_is("adapter", NOT_NULL))))

    adapter: str | None = Field(None, json_schema_extra=NAME_SCHEMA)
    revision: str | None = Field(None, json_schema_extra=REVISION_SCHEMA)

    @model_validator(mode="after")
    def _rev_needs_adapter(self) -> "Target":
        if self.revision is not None and self.adapter is None:
            raise ValueError("revision needs adapter")
        return self


class _SuiteChoice(_Wire):
    model_config = ConfigDict(json_schema_extra=rules(
        {"oneOf": [field_is("suite", NOT_NULL), field_is("inline_suite", NOT_NULL)]}))

    suite: str | None = Field(None, json_schema_extra=SUITE_NAME_SCHEMA)
    inline_suite: SuiteSpec | None = None

    @model_validator(mode="after")
    def _one_suite(self) -> "_SuiteChoice":
        if (self.suite is None) == (self.inline_suite is None):
            raise ValueError("give exactly one of `suite` (a stored suite's name) or `inline_suite`")
        return self


class RunRequest(_SuiteChoice):
    """``POST /v1/evals/runs``: a stored suite (``suite``) or an inline one (``inline_suite``) against a target."""

    target: Target = Target()


class CompareRequest(_SuiteChoice):
    """``POST /v1/evals/comparisons``: up to 8 targets on one suite, paired per example."""

    targets: list[Target] = Field(min_length=2, max_length=MAX_COMPARE_TARGETS)


class ReplayRequest(_Wire):
    run_id: str = Field(json_schema_extra=RUN_ID_SCHEMA)

    @field_validator("run_id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not RUN_ID_RE.fullmatch(v):
            raise ValueError("run IDs look like 'eval-0123456789abcdef'")
        return v


class PostEval(_Wire):
    """The post-train gate attached to a training request (see docs/evals.md)."""

    suite: str = Field(json_schema_extra=SUITE_NAME_SCHEMA)
    baseline: Target = Target()
    rule: Literal["paired_wilson_v1"] = "paired_wilson_v1"
    min_accuracy: float = Field(0.5, ge=0.0, le=1.0, allow_inf_nan=False)
    min_pairs: int = Field(20, ge=1, le=MAX_EXAMPLES)
    activate_on_pass: bool = False
    set_default_on_pass: bool = False  # a promoted, activated revision also becomes the server default adapter

    model_config = ConfigDict(json_schema_extra=rules(
        when(field_is("set_default_on_pass", {"const": True}), field_is("activate_on_pass", {"const": True}))))

    _suite_name = field_validator("suite")(classmethod(lambda cls, v: _check_suite_name(v)))

    @model_validator(mode="after")
    def _default_needs_activation(self) -> "PostEval":
        if self.set_default_on_pass and not self.activate_on_pass:
            raise ValueError("set_default_on_pass needs activate_on_pass: only a served revision can be the default")
        return self


class GateRequest(_Wire):
    """``POST /v1/evals/gate``: run the gate for a published candidate against a baseline."""

    candidate: AdapterRef
    post_eval: PostEval


# the dataset_path the service can open, as a JSON Schema pattern (a little stricter than the service, which
# also takes "./a" and "a//b"): parts that are not empty, "." or "..", and no NUL. A lone surrogate (which JSON
# text can hold and no file name can) is left out: ECMA-262 patterns, which JSON Schema's are, cannot name one
# the same way in every validator, and schemathesis drops a pattern that tries
_PART = r"(?:[^/.\x00][^/\x00]*|\.[^/.\x00][^/\x00]*|\.\.[^/\x00]+)"
DATASET_PATH_PATTERN = rf"^{_PART}(?:/{_PART})*$"


class ImportRequest(_Wire):
    """``POST /v1/evals/suites/import``: JSONL rows (``{"id"?, "messages", "reference"}``) plus the suite's
    scorers and settings. ``jsonl`` is the text itself; ``dataset_path`` names a file in ``eval_dir/datasets``.
    Exactly one of the two (checked in ``EvalService.import_jsonl``, stated here for the schema)."""

    model_config = ConfigDict(json_schema_extra=rules(
        {"oneOf": [field_is("jsonl", NOT_NULL), field_is("dataset_path", NOT_NULL)]}))

    name: str = Field(json_schema_extra=SUITE_NAME_SCHEMA)
    description: str = Field("", max_length=4_096)
    # text with no row (empty or blank) is refused here: a non-space character (JSONL content is checked on import)
    jsonl: Annotated[str, Field(json_schema_extra=NOT_BLANK_SCHEMA)] | None = None
    dataset_path: Annotated[str, Field(max_length=1_024, json_schema_extra={"pattern": DATASET_PATH_PATTERN})] | None = \
        Field(None, description="relative, inside eval_dir/datasets: '/'-separated parts, none empty, '.' or "
                                 "'..'")
    scorers: list[Scorer] = Field(min_length=1, max_length=MAX_SCORERS)
    generation: GenerationSettings = GenerationSettings()
    aggregation: Literal["mean", "pass@k", "majority@k"] = "mean"
    replace: bool = False
