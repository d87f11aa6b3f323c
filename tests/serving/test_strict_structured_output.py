"""Strict structured output by default, its opt-out, and forced calls cut by ``max_tokens``.

A tiny random Qwen3 with the real Qwen3 tokenizer and template (:mod:`tests.realtok`) is served by a real
``kiln serve``. A schema that does not say ``additionalProperties`` is closed by default (as vLLM's default
grammar backend reads it), so a forced call's arguments end; ``allow_additional_properties: true`` restores
JSON Schema's open objects. A ``logit_bias`` of +100 on the comma token makes the model add a key wherever
the grammar lets it, so both outcomes are certain on any CPU.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kiln.runtime.strict_schema import close_schema
from tests.realtok import real_model_dir
from tests.serving.conftest import start_server, stop_server

PERMISSIVE = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PERMISSIVE}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    srv = start_server(real_model_dir("qwen3"), tmp_path_factory.mktemp("strict-qwen3"),
                       extra_args=["--no-training", "--max-model-len", "2048"], env_extra={}, config=None)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(qwen3):
    return openai.OpenAI(base_url=f"{qwen3.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _comma_bias(srv) -> dict[str, int]:
    ids = httpx.post(f"{srv.base_url}/tokenize", json={"model": srv.model_id, "prompt": ","}, timeout=30).json()
    assert len(ids["tokens"]) == 1
    return {str(ids["tokens"][0]): 100}


def test_close_schema_closes_only_what_the_schema_leaves_open():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "object", "additionalProperties": True},
        "c": {"type": "array", "prefixItems": [{"type": "string"}]},
        "d": {"allOf": [{"properties": {"p": {"type": "string"}}}, {"properties": {"q": {"type": "string"}}}]},
        "e": {"enum": [{"properties": 1}]}},
        "$defs": {"n": {"properties": {"m": {"$ref": "#/$defs/n"}}}}}
    before = json.dumps(schema)
    out = close_schema(schema)
    assert json.dumps(schema) == before  # the input is not modified
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["additionalProperties"] is True
    assert out["properties"]["c"]["items"] is False
    assert all("additionalProperties" not in m for m in out["properties"]["d"]["allOf"])
    assert out["properties"]["e"] == {"enum": [{"properties": 1}]}  # data, not a schema
    assert out["$defs"]["n"]["additionalProperties"] is False
    deep: dict = {"type": "object"}
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = {"type": "object", "properties": {"k": deep}}
    assert close_schema(deep)["additionalProperties"] is False


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_closes_a_permissive_schema(qwen3, client, choice):
    """Without additionalProperties in the schema the forced arguments still end (strict default), even
    with every step pushed towards another key."""
    r = client.chat.completions.create(model=qwen3.model_id, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice=choice, max_tokens=64, temperature=1.0, seed=1,
                                       parallel_tool_calls=False, logit_bias=_comma_bias(qwen3))
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


def test_opt_out_restores_open_objects_and_a_cut_call_is_reported(qwen3, client):
    """``allow_additional_properties: true``: the object stays open, the comma-loving model keeps adding to
    it until max_tokens; the cut call comes back as a call with the arguments written so far and
    ``finish_reason: length``, never as raw ``<tool_call>`` text in the content (streamed alike)."""
    kw = dict(model=qwen3.model_id, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=24,
              temperature=0, parallel_tool_calls=False, logit_bias=_comma_bias(qwen3),
              extra_body={"allow_additional_properties": True})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city":"Paris",')
    content, args, reason = "", "", None
    for ev in client.chat.completions.create(**kw, stream=True):
        d = ev.choices[0].delta
        content += d.content or ""
        args += "".join(t.function.arguments or "" for t in d.tool_calls or ())
        reason = ev.choices[0].finish_reason or reason
    assert reason == "length" and "<tool_call>" not in content and args == call.function.arguments


def test_cut_before_the_name_leaves_no_tag_text(qwen3, client):
    c = client.chat.completions.create(model=qwen3.model_id, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice="required", max_tokens=2, temperature=0).choices[0]
    assert c.finish_reason == "length" and c.message.content is None and not c.message.tool_calls


def test_response_format_schema_is_strict_by_default(qwen3, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": PERMISSIVE}}
    kw = dict(model=qwen3.model_id, messages=MESSAGES, response_format=fmt, max_tokens=24, temperature=0,
              logit_bias=_comma_bias(qwen3))
    strict = client.chat.completions.create(**kw).choices[0]
    assert strict.finish_reason == "stop" and json.loads(strict.message.content) == {"city": "Paris"}
    open_ = client.chat.completions.create(**kw, extra_body={"allow_additional_properties": True}).choices[0]
    assert open_.message.content.startswith('{"city":"Paris",')
