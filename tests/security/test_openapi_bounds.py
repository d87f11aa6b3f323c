"""Issue 45 item 10: /openapi.json states the bounds only the running server knows (its configured
``limits.*``, its vocabulary, its context, its reasoning parser), and the server agrees with the
document at each edge: the last value the document admits is not refused for that bound, the first
one it excludes is (the same 400 as before: ``limit_exceeded``, ``invalid_token_id``,
``context_length_exceeded``). Before, the document stated only the static ceilings (``n`` <= 256, any
token ID), and schemathesis' positive_data_acceptance counted these refusals of schema-valid input.

The server is ``secure_server`` (tests/security/conftest.py): ``limits.max_model_len`` 256,
``max_tokens_cap`` 32, ``max_n`` 4, the other limits at their defaults.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest

from kiln.config import LimitsSettings
from kiln.serving.openapi_bounds import decimals_below
from tests.security.conftest import SECURE_ENV
from tests.security.test_wire_rules import _request_schema, _schema_valid

DEFAULTS = LimitsSettings()
MAX_N = int(SECURE_ENV["KILN_LIMITS_MAX_N"])
MAX_TOKENS_CAP = int(SECURE_ENV["KILN_LIMITS_MAX_TOKENS_CAP"])
MAX_MODEL_LEN = int(SECURE_ENV["KILN_LIMITS_MAX_MODEL_LEN"])
HI = [{"role": "user", "content": "hi"}]


def _stated(schema: dict[str, Any], keyword: str, *, items: bool = False) -> set[int]:
    """The values of ``keyword`` in ``schema``, its ``anyOf`` members and (``items``) the items of its arrays."""
    found = {schema[keyword]} if keyword in schema and not items else set()
    for member in schema.get("anyOf", ()):
        found |= _stated(member, keyword, items=items)
    inner = schema.get("items")
    if items and isinstance(inner, dict):
        found |= {inner[keyword]} if keyword in inner else _stated(inner, keyword, items=True)
    return found


def _prop(checker, component: str, prop: str) -> dict[str, Any]:
    return checker.doc["components"]["schemas"][component]["properties"][prop]


@pytest.mark.parametrize("component,prop,keyword,bound", [
    *[(c, "n", "maximum", MAX_N) for c in ("ChatCompletionRequest", "CompletionRequest", "BatchCompletionRequest")],
    *[(c, "max_tokens", "maximum", MAX_TOKENS_CAP)
      for c in ("ChatCompletionRequest", "CompletionRequest", "BatchCompletionRequest")],
    ("ChatCompletionRequest", "max_completion_tokens", "maximum", MAX_TOKENS_CAP),
    *[(c, "stop", "maxItems", DEFAULTS.max_stop_sequences)
      for c in ("ChatCompletionRequest", "CompletionRequest", "BatchCompletionRequest")],
    ("ChatCompletionRequest", "top_logprobs", "maximum", DEFAULTS.max_logprobs),
    ("CompletionRequest", "logprobs", "maximum", DEFAULTS.max_logprobs),
    ("BatchCompletionRequest", "logprobs", "maximum", DEFAULTS.max_logprobs),
    ("CompletionRequest", "prompt_logprobs", "maximum", DEFAULTS.max_prompt_logprobs),
    ("ChatCompletionRequest", "messages", "maxItems", DEFAULTS.max_messages),
    ("TokenizeChatRequest", "messages", "maxItems", DEFAULTS.max_messages),
    ("BatchCompletionRequest", "prompts", "maxItems", DEFAULTS.max_batch_prompts),
])
def test_document_states_the_configured_limit(checker, component, prop, keyword, bound):
    assert _stated(_prop(checker, component, prop), keyword) == {bound}


def test_document_states_the_vocabulary_and_the_context_for_every_token_id(checker):
    last = _stated(_prop(checker, "DetokenizeRequest", "tokens"), "maximum", items=True)
    assert len(last) == 1 and min(last) > 0
    for component, prop in (("CompletionRequest", "prompt"), ("BatchCompletionRequest", "prompts"),
                            *[(c, "stop_token_ids") for c in ("ChatCompletionRequest", "CompletionRequest",
                                                              "BatchCompletionRequest")]):
        assert _stated(_prop(checker, component, prop), "maximum", items=True) == last, (component, prop)
    # a token-ID prompt: max_model_len - 1 IDs at most (one more leaves no room for an answer)
    ids = [m for m in _prop(checker, "CompletionRequest", "prompt")["anyOf"]
           if m.get("items", {}).get("type") == "integer"]
    assert [m["maxItems"] for m in ids] == [MAX_MODEL_LEN - 1]
    keys = [m["propertyNames"]["pattern"] for m in _prop(checker, "CompletionRequest", "logit_bias")["anyOf"]
            if "propertyNames" in m]
    assert keys == [decimals_below(min(last) + 1, 9)]


def test_document_says_thinking_token_budget_is_refused_without_a_reasoning_parser(checker):
    """The built-in test model's template has no reasoning parser: only null (or omitting it) is accepted."""
    assert _prop(checker, "ChatCompletionRequest", "thinking_token_budget")["type"] == "null"


def _vocab_last(checker) -> int:
    return next(iter(_stated(_prop(checker, "DetokenizeRequest", "tokens"), "maximum", items=True)))


# (bound, path, the body with the value, the value the document admits last (from the document), code past it)
EDGES: list[tuple[str, str, Callable[[Any], dict[str, Any]], Callable[[Any], Any], str]] = [
    ("n", "/v1/completions", lambda v: {"prompt": "a", "max_tokens": 1, "n": v}, lambda c: MAX_N, "limit_exceeded"),
    ("max_tokens", "/v1/chat/completions", lambda v: {"messages": HI, "max_tokens": v},
     lambda c: MAX_TOKENS_CAP, "limit_exceeded"),
    ("top_logprobs", "/v1/chat/completions", lambda v: {"messages": HI, "max_tokens": 1, "logprobs": True,
                                                         "top_logprobs": v},
     lambda c: DEFAULTS.max_logprobs, "limit_exceeded"),
    ("prompt_logprobs", "/v1/completions", lambda v: {"prompt": "a b", "max_tokens": 1, "prompt_logprobs": v},
     lambda c: DEFAULTS.max_prompt_logprobs, "limit_exceeded"),
    ("stop", "/v1/completions", lambda v: {"prompt": "a", "max_tokens": 1, "stop": [f"s{i}" for i in range(v)]},
     lambda c: DEFAULTS.max_stop_sequences, "limit_exceeded"),
    ("messages", "/tokenize", lambda v: {"messages": HI * v}, lambda c: DEFAULTS.max_messages, "limit_exceeded"),
    ("prompts", "/v1/completions/batch", lambda v: {"prompts": ["a"] * v, "max_tokens": 1},
     lambda c: DEFAULTS.max_batch_prompts, "limit_exceeded"),
    ("a token ID", "/detokenize", lambda v: {"tokens": [v]}, _vocab_last, "invalid_token_id"),
    ("a token ID in a prompt", "/v1/completions", lambda v: {"prompt": [v], "max_tokens": 1}, _vocab_last,
     "invalid_token_id"),
    ("a logit_bias key", "/v1/completions", lambda v: {"prompt": "a", "max_tokens": 1, "logit_bias": {str(v): 1}},
     _vocab_last, "invalid_token_id"),
    ("a token-ID prompt's length", "/v1/completions", lambda v: {"prompt": [1] * v, "max_tokens": 1},
     lambda c: MAX_MODEL_LEN - 1, "context_length_exceeded"),
]


@pytest.mark.parametrize("bound,path,body,last,code", EDGES, ids=[e[0] for e in EDGES])
def test_server_agrees_with_the_document_at_the_edge(client, checker, bound, path, body, last, code):
    model = client.get("/v1/models").json()["data"][0]["id"]
    at, past = body(last(checker)), body(last(checker) + 1)
    if path.startswith("/v1/"):
        at, past = {**at, "model": model}, {**past, "model": model}
    schema = _request_schema(checker, path)
    assert _schema_valid(checker, schema, at), f"{bound}: the document refuses its own last value"
    assert not _schema_valid(checker, schema, past), f"{bound}: the document admits one past the bound"
    r = client.post(path, json=at)
    assert r.status_code == 200, r.text
    r = client.post(path, json=past)
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


def test_thinking_token_budget_refused_as_the_document_says(client, checker):
    model = client.get("/v1/models").json()["data"][0]["id"]
    asked = {"model": model, "messages": HI, "max_tokens": 1, "thinking_token_budget": 8}
    assert not _schema_valid(checker, _request_schema(checker, "/v1/chat/completions"), asked)
    r = client.post("/v1/chat/completions", json=asked)
    assert r.status_code == 400 and "reasoning parser" in r.json()["error"]["message"], r.text
    assert client.post("/v1/chat/completions", json={**asked, "thinking_token_budget": None}).status_code == 200


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 99, 100, 551, 1000, 1001, 151_936, 248_320, 10**9])
def test_decimals_below_is_exactly_the_keys_under_the_vocabulary(n):
    pattern = re.compile(decimals_below(n, 9))
    values = {*range(min(n + 20, 2_000)), n - 1, n, n + 1, 10 * n, 10**9 - 1}
    for v in values:
        text = str(v)
        for key in {text, text.zfill(9), "0" + text}:
            if len(key) <= 9:
                assert bool(pattern.fullmatch(key)) == (v < n), (n, key)


def _request_components() -> dict[str, Any]:
    """The five request schemas apply_runtime_bounds lowers, as pydantic generates them (static ceilings)."""
    from pydantic.json_schema import models_json_schema

    from kiln.serving import protocol as p

    models = (p.ChatCompletionRequest, p.CompletionRequest, p.BatchCompletionRequest, p.TokenizeChatRequest,
              p.DetokenizeRequest)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/$defs/{model}")
    return defs["$defs"]


def test_no_stop_sequences_allowed_refuses_a_single_stop_string_in_the_document():
    """``limits.max_stop_sequences = 0``: the server refuses ``stop: "x"`` (one sequence, over 0), so the
    document must not admit it either; before, only the array member was lowered and the string stayed."""
    import jsonschema

    from kiln.serving.openapi_bounds import RuntimeBounds, apply_runtime_bounds
    from kiln.serving.prepare import check_limits
    from kiln.errors import InvalidRequest

    limits = LimitsSettings(max_stop_sequences=0)
    components = _request_components()
    apply_runtime_bounds(components, RuntimeBounds(vocab_size=100, max_model_len=64, max_request_rows=8,
                                                   limits=limits))
    stop = components["CompletionRequest"]["properties"]["stop"]
    check = jsonschema.Draft202012Validator(stop)
    assert not check.is_valid("x") and not check.is_valid(["x"])
    assert check.is_valid([]) and check.is_valid(None)
    state = type("S", (), {"settings": type("T", (), {"limits": limits})()})()
    req = type("R", (), {"n": 1})()
    check_limits(state, req, None, [])  # what the document admits passes
    with pytest.raises(InvalidRequest, match="max_stop_sequences=0"):
        check_limits(state, req, None, ["x"])
    # with a bound of 1 or more, a lone string stays admitted (it is one sequence)
    components = _request_components()
    apply_runtime_bounds(components, RuntimeBounds(vocab_size=100, max_model_len=64, max_request_rows=8,
                                                   limits=LimitsSettings(max_stop_sequences=1)))
    assert jsonschema.Draft202012Validator(components["ChatCompletionRequest"]["properties"]["stop"]).is_valid("x")


def test_a_queue_of_zero_rows_is_a_config_error():
    """``batching.max_queued_rows = 0`` would refuse every generation request (no row can queue) while the
    document still admitted ``n = 1``: the setting is refused at load instead."""
    from pydantic import ValidationError

    from kiln.config import BatchingSettings

    assert BatchingSettings(max_queued_rows=1).max_queued_rows == 1
    with pytest.raises(ValidationError, match="max_queued_rows"):
        BatchingSettings(max_queued_rows=0)
