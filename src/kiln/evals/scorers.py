"""Deterministic scorers (everything but the model judge) and suite validation.

Each scorer maps ``(completion, example)`` to a :class:`Score` (``passed`` plus a
short ``detail``). They run on the eval worker thread, never on the event loop.
User-supplied regular expressions are RE2 (linear time, bounded memory, no
backreferences), so no pattern can hang the worker. JSON Schemas are checked
against their meta-schema at validation time and never resolve a remote ``$ref``.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any

from kiln.errors import InvalidRequest
from kiln.evals import schemas as s

RE2_MAX_MEM = 8 * 1024 * 1024
MAX_SCORED_CHARS = 64 * 1024  # completions longer than this are scored on their first chars
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_PUNCT = str.maketrans("", "", string.punctuation)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class SuiteInvalid(InvalidRequest):
    code = "invalid_suite"
    default_hint = "fix the suite definition; see docs/evals.md"


@dataclass(frozen=True)
class Score:
    passed: bool
    detail: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "detail": self.detail}


def normalise(text: str, spec: s.ExactScorer) -> str:
    if spec.strip:
        text = text.strip()
    if not spec.case_sensitive:
        text = text.casefold()
    if spec.strip_punctuation:
        text = text.translate(_PUNCT)
    if spec.collapse_whitespace:
        text = " ".join(text.split())
    return text


def compile_regex(spec: s.RegexScorer, reference: str) -> Any:
    import re2

    pattern = spec.pattern.replace("{reference}", re2.escape(reference)) if "{reference}" in spec.pattern \
        else spec.pattern
    if spec.full_match:
        pattern = f"(?:{pattern})\\z"
    options = re2.Options()
    options.max_mem = RE2_MAX_MEM
    options.case_sensitive = spec.case_sensitive
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        raise SuiteInvalid(f"regex scorer pattern does not compile under RE2: {exc}", code="invalid_regex",
                           hint="RE2 syntax: no backreferences or lookaround") from None


def _check_schema(schema: dict[str, Any]) -> Any:
    import jsonschema

    if len(json.dumps(schema)) > s.MAX_SCHEMA_BYTES:
        raise SuiteInvalid(f"json_schema is larger than {s.MAX_SCHEMA_BYTES} bytes", code="schema_too_large")
    _refuse_remote_refs(schema)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SuiteInvalid(f"json_schema is not a valid JSON Schema: {exc.message}", code="invalid_json_schema") \
            from None
    return cls


def _refuse_remote_refs(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str) and not value.startswith("#"):
                raise SuiteInvalid(f"json_schema has a non-local $ref {value!r}", code="remote_ref",
                                   hint="only '#/...' references inside the schema are allowed")
            _refuse_remote_refs(value)
    elif isinstance(node, list):
        for item in node:
            _refuse_remote_refs(item)


def json_schema_validator(schema: dict[str, Any]) -> Any:
    """A validator whose registry resolves nothing remote (any non-local $ref was refused already)."""
    from referencing import Registry

    cls = _check_schema(schema)
    return cls(schema, registry=Registry())


def validate_suite(suite: s.SuiteSpec, *, allow_code_execution: bool) -> None:
    """Everything checkable before a run: patterns compile, schemas are valid, references fit the scorers."""
    for spec in suite.scorers:
        if isinstance(spec, s.CodeScorer) and not allow_code_execution:
            raise SuiteInvalid("the code scorer is disabled on this server", code="code_execution_disabled",
                               hint="set eval.allow_code_execution = true (KILN_EVAL_ALLOW_CODE_EXECUTION=1)")
        if isinstance(spec, s.RegexScorer):
            for ex in suite.examples if "{reference}" in spec.pattern else suite.examples[:1]:
                compile_regex(spec, ex.reference)
        if isinstance(spec, s.JsonSchemaScorer):
            _check_schema(spec.json_schema)
        if isinstance(spec, s.NumericScorer):
            for i, ex in enumerate(suite.examples):
                if _last_number(ex.reference) is None:
                    raise SuiteInvalid(f"example {i}: the numeric scorer needs a number as reference",
                                       code="invalid_reference")
        if isinstance(spec, s.ChoiceScorer):
            for i, ex in enumerate(suite.examples):
                if ex.reference.strip().upper() not in spec.choices:
                    raise SuiteInvalid(f"example {i}: reference {ex.reference!r} is not one of {spec.choices}",
                                       code="invalid_reference")
        if isinstance(spec, s.JudgeScorer) and spec.mode == "preference":
            for i, ex in enumerate(suite.examples):
                if not ex.reference.strip():
                    raise SuiteInvalid(f"example {i}: a preference judge compares the answer with the reference, "
                                       "and this example has none", code="invalid_reference")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    try:
        return float(found[-1])
    except ValueError:
        return None


def extract_code(completion: str) -> str:
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


class Scorers:
    """The deterministic scorers of one suite, compiled once (regexes per reference, schemas)."""

    def __init__(self, suite: s.SuiteSpec, *, allow_code_execution: bool, sandbox: Any = None):
        self.suite = suite
        self.allow_code = allow_code_execution
        self.sandbox = sandbox
        self._regex: dict[tuple[int, str], Any] = {}
        self._schema: dict[int, Any] = {}
        for i, spec in enumerate(suite.scorers):
            if isinstance(spec, s.JsonSchemaScorer):
                self._schema[i] = json_schema_validator(spec.json_schema)

    def score(self, index: int, spec: Any, completion: str, example: s.EvalExample) -> Score:
        text = completion[:MAX_SCORED_CHARS]
        ref = example.reference
        if isinstance(spec, s.ExactScorer):
            return Score(normalise(text, spec) == normalise(ref, spec))
        if isinstance(spec, s.ContainsScorer):
            if spec.case_sensitive:
                return Score(ref in text)
            return Score(ref.casefold() in text.casefold())
        if isinstance(spec, s.RegexScorer):
            key = (index, ref if "{reference}" in spec.pattern else "")
            rx = self._regex.get(key)
            if rx is None:
                rx = self._regex[key] = compile_regex(spec, ref)
            return Score(rx.search(text) is not None)
        if isinstance(spec, s.NumericScorer):
            got, want = _last_number(text), _last_number(ref)
            if got is None or want is None:
                return Score(False, "no number in the completion")
            tol = max(spec.abs_tol, spec.rel_tol * abs(want))
            return Score(abs(got - want) <= tol, f"got {got:g}, want {want:g}")
        if isinstance(spec, s.JsonValidScorer):
            try:
                json.loads(text)
            except ValueError as exc:
                return Score(False, f"invalid JSON: {exc}")
            return Score(True)
        if isinstance(spec, s.JsonSchemaScorer):
            try:
                value = json.loads(text)
            except ValueError as exc:
                return Score(False, f"invalid JSON: {exc}")
            err = next(iter(self._schema[index].iter_errors(value)), None)
            return Score(err is None, None if err is None else err.message[:200])
        if isinstance(spec, s.ChoiceScorer):
            letters = re.findall(rf"\b([{spec.choices}])\b", text)
            got = letters[0] if letters else None
            return Score(got == ref.strip().upper(), f"chose {got}")
        if isinstance(spec, s.CodeScorer):
            if not self.allow_code or self.sandbox is None:
                return Score(False, "code execution is disabled")
            result = self.sandbox(extract_code(completion) + "\n\n" + ref, timeout_s=spec.timeout_s,
                                  memory_mb=spec.memory_mb)
            return Score(result.passed, result.detail)
        raise TypeError(f"{type(spec).__name__} is not a deterministic scorer")


# ------------------------------------------------------------------------------------ judge
# The judge itself is a model (the engine's base model or an adapter) and runs where an engine is:
# evals (kiln.evals.service) and GRPO rewards (kiln.training.grpo.rewards) build its prompt and read its
# verdict with these two functions.
JUDGE_PLACEHOLDER = re.compile(r"\{(question|reference|answer)\}")
JUDGE_VERDICT_WORD = re.compile(r"\b(PASS|FAIL)\b", re.IGNORECASE)


def judge_prompt(spec: s.JudgeScorer, question: str, reference: str, answer: str) -> str:
    """The rubric with ``{question}``, ``{reference}`` and ``{answer}`` filled in one pass (no re-expansion)."""
    fields = {"question": question, "reference": reference, "answer": answer}
    return JUDGE_PLACEHOLDER.sub(lambda m: fields[m.group(1)], spec.rubric)


def judge_verdict(reply: str) -> Score:
    """The first ``PASS``/``FAIL`` word of the judge's reply; neither: fail, reported as unparsed."""
    m = JUDGE_VERDICT_WORD.search(reply)
    return Score(bool(m) and m.group(1).upper() == "PASS", reply if m else f"unparsed verdict: {reply}")

