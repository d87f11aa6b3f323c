"""What schemathesis recorded, and which refusals of schema-valid input the schema cannot prevent.

``recorded_failures`` reads the run's NDJSON events (``--report ndjson``): every failed check of every case,
and every scenario that errored, with the request and the response's error envelope.

``SCHEMA_CANNOT_STATE`` is the closed list of 400s a request the OpenAPI document admits may still get
(docs/security.md, "Request limits the API states up front"). Each entry names the operation, the error
``code`` and a pattern of the message, so one refusal explains only itself: a rule the schema could state
(a pattern, a bound, a rule across fields, an integral float) is not in it and fails the fuzz test.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ANY = r".*"
GENERATION = r"POST /(v1/chat/completions|v1/completions|v1/completions/batch|tokenize|detokenize)"
EVAL_SUITES = r"POST /v1/evals/(suites|suites/import|runs|comparisons)"
# (operation regex, error code, message regex, reason): matched with re.fullmatch / re.search
#
# Not here, because the document states them or HTTP does: the configured limits.* and the vocabulary's size
# (the served document's bounds, kiln.serving.openapi_bounds); what the server's state decides (a credential not
# configured or a judge not loaded: 404; too few judgments stored: 409), which positive_data_acceptance accepts.
SCHEMA_CANNOT_STATE: list[tuple[str, str, str, str]] = [
    # the model's tokenizer: how many tokens a text makes (token-ID prompts are bounded in the document)
    (ANY, "context_length_exceeded", r"tokens", "a prompt's token count"),
    (r"POST /v1/judgments/train", "example_too_long", r"tokens; max_seq_len", "a prompt's token count"),
    # what a value holds, beyond a JSON Schema pattern
    (r"POST /v1/adapters/[^/]+/upload", "unsafe_archive", ANY, "the bytes of an upload (a gzip tar with the "
                                                                 "adapter's two files)"),
    (EVAL_SUITES, "invalid_regex", r"under RE2", "a regex's syntax (RE2)"),
    (EVAL_SUITES, "invalid_jsonl", r"is not JSON", "JSONL text"),
    (r"POST /v1/evals/suites/import", "invalid_suite", r"the imported suite is invalid",
     "JSONL rows that are not eval examples"),
    (EVAL_SUITES, "dataset_outside_eval_dir", r"not valid UTF-8", "a lone surrogate in a file name"),
    # rules relating values that JSON Schema cannot compare, or an array's last item
    (EVAL_SUITES, "invalid_reference", r"is not one of [A-Z]+", "a reference against its scorer's choices"),
    (r"POST /v1/judgments", "invalid_request", r"response_a and response_b are the same text",
     "two answers that must differ"),
    (GENERATION, "invalid_request", r"min_tokens=\d+ exceeds max_tokens=\d+", "two numbers compared"),
    (GENERATION, "limit_exceeded", r"batching\.max_queued_rows", "prompts x n rows (a product of two fields)"),
    (r"POST /v1/(evals/(suites|runs|comparisons)|train/\w+)", "invalid_request",
     r"the last one must not be an assistant turn", "the role of the last message"),
]


@dataclass(frozen=True)
class Recorded:
    check: str
    operation: str  # "POST /v1/judgments" (the case's path template)
    status: int
    code: str
    message: str
    body: Any
    media_type: str | None

    def schema_valid(self, checker: Any) -> bool:
        """Whether the JSON body validates against the operation's request schema (jsonschema, 2020-12);
        True where there is no JSON body to judge."""
        if self.media_type != "application/json" or self.body is None:
            return True
        method, path = self.operation.split(" ", 1)
        _, op = checker.operation(method, re.sub(r"\{[^}]+\}", "x", path))
        schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            return True
        try:
            checker.validate(self.body, schema, self.operation)
        except AssertionError:
            return False
        return True


def cannot_state(f: Recorded) -> str | None:
    """The reason from ``SCHEMA_CANNOT_STATE`` that explains this 400, or None."""
    if f.status != 400:
        return None
    for operation, code, message, reason in SCHEMA_CANNOT_STATE:
        if re.fullmatch(operation, f.operation) and f.code == code and re.search(message, f.message):
            return reason
    return None


def recorded_failures(events: Path) -> list[Recorded]:
    """Every failed check (and errored scenario) in schemathesis' NDJSON events."""
    out: list[Recorded] = []
    with events.open() as fh:
        for line in fh:
            event = json.loads(line).get("ScenarioFinished")
            if event is None:
                continue
            recorder = event["recorder"]
            if event["status"] == "error":
                out.append(Recorded("error", recorder["label"], 0, "", json.dumps(event)[:2000], None, None))
            for case_id, checks in (recorder.get("checks") or {}).items():
                for check in checks:
                    if check["status"] == "failure":
                        out.append(_recorded(check["name"], recorder, case_id))
    return out


def _recorded(check: str, recorder: dict[str, Any], case_id: str) -> Recorded:
    case = recorder["cases"][case_id]["value"]
    response = (recorder.get("interactions") or {}).get(case_id, {}).get("response") or {}
    content = response.get("content") or {}
    text = base64.b64decode(content["$base64"]).decode(errors="replace") if "$base64" in content else ""
    try:
        error = json.loads(text)["error"]
        code, message = str(error.get("code")), str(error.get("message"))
    except (ValueError, KeyError, TypeError):
        code, message = "", text[:500]
    return Recorded(check, f"{case['method']} {case['path']}", int(response.get("status_code", 0)), code, message,
                    case.get("body"), case.get("media_type"))
