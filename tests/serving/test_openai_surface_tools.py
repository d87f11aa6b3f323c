"""Tool calling through the official ``openai`` client, streaming and not.

The built-in model's own chat template has a tools section (Hermes/Qwen style: tools listed in
the system turn, calls as ``<tool_call>`` JSON blocks, results in ``<tool_response>``), and its
training text has a few ``get_weather(city)`` calls: with that tool offered, ``auto`` (greedy)
gets a real call from the model itself. ``required`` and named ``tool_choice`` are enforced by
constrained decoding, so they hold for any tools. The parser itself is tested on fixed texts,
whole and streamed in pieces.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kiln.runtime.builtin import CHAT_TEMPLATE, WEATHER_TOOL
from kiln.serving.tool_parsers import HermesParser, get_tool_parser
from tests.serving.conftest import start_server, stop_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(builtin_model_dir, tmp_path_factory):
    """The built-in model as shipped, with the default limits (the shared server's 512-token
    context is too short for two tools' JSON and a long answer)."""
    home = tmp_path_factory.mktemp("tools-home")
    srv = start_server(builtin_model_dir, home, extra_args=["--no-training"], env_extra={}, config=None)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _args_valid(call, tool):
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_forces_a_valid_call(client, tools_server):
    r = client.chat.completions.create(model=tools_server.model_id, messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=120, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _args_valid(call, WEATHER)


def test_required_with_parallel_calls_off_gives_one_valid_call(client, tools_server):
    r = client.chat.completions.create(model=tools_server.model_id, messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                       temperature=1.0, seed=5, n=3)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        _args_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_streamed_tool_calls_match_the_whole_answer(client, tools_server):
    kw = dict(model=tools_server.model_id, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
              parallel_tool_calls=False, max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reason = None
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            for tc in ch.delta.tool_calls or ():
                if tc.index not in calls:  # the first piece names the call
                    assert tc.id and tc.type == "function" and tc.function.name
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": "", "pieces": 0})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
                entry["pieces"] += 1
            reason = ch.finish_reason or reason
    assert reason == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    for c in calls.values():  # the arguments arrived in fragments as they were generated, and add up to JSON
        assert c["pieces"] > 2 and isinstance(json.loads(c["arguments"]), dict)


def test_parallel_calls_each_valid(client, tools_server):
    r = client.chat.completions.create(model=tools_server.model_id, messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=300, temperature=1.0, seed=11, n=2)
    for c in r.choices:
        assert c.message.tool_calls, c.message.content  # the first call fits in max_tokens
        assert [t.id for t in c.message.tool_calls] == list(dict.fromkeys(t.id for t in c.message.tool_calls))
        for call in c.message.tool_calls:
            _args_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_tool_results_go_back_through_the_template(client, tools_server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = client.chat.completions.create(model=tools_server.model_id, messages=history, tools=[WEATHER],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt is exactly what transformers' apply_chat_template renders with the same tools
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tools_server.model_dir)
    hf_msgs = [dict(m) for m in history]
    hf_msgs[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "c"}}}]}
    text = tok.apply_chat_template(hf_msgs, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n18 C and sunny" in text and "get_weather" in text
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_auto_gets_a_real_call_from_the_builtin_model(client, tools_server):
    """Asked as its training examples ask, with their tool offered, the model calls it on its own."""
    kw = dict(model=tools_server.model_id, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="auto",
              max_tokens=60, temperature=0)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    _args_valid(c.message.tool_calls[0], WEATHER_TOOL)
    streamed: dict[int, list[str]] = {}
    for ev in client.chat.completions.create(stream=True, **kw):
        for tc in ev.choices[0].delta.tool_calls or ():
            entry = streamed.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
    assert list(streamed.values()) == [[t.function.name, t.function.arguments] for t in c.message.tool_calls]


def test_auto_and_none_answer_in_shape(client, tools_server):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=tools_server.model_id, messages=MESSAGES, tools=[WEATHER],
                                           tool_choice=choice, max_tokens=12, temperature=0)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert c.message.tool_calls or isinstance(c.message.content, str)


def test_required_tool_call_on_the_shared_server(oai, server):
    """The shared server (a 512-token context) forces a valid call of a tool the model never saw."""
    r = oai.chat.completions.create(model=server.model_id, messages=MESSAGES, tools=[TIME], tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=80, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_time"
    _args_valid(c.message.tool_calls[0], TIME)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
])
def test_tool_errors(oai, server, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=5, **extra)
    if param:
        assert exc.value.body["param"] == param


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "x"}],  # no tool_call_id
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "x", "tool_call_id": "c"}],
    [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}],
])
def test_message_shape_errors(http, server, messages):
    r = http.post("/v1/chat/completions", json={"model": server.model_id, "messages": messages})
    assert r.status_code == 400


TEXTS = [
    'Sure.<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
    '</tool_call>',
    "no calls here, just <tool_ text",
    '<tool_call>not json</tool_call> after',
    '<tool_call>\n{"name": "c", "arguments": "{\\"y\\": 2}"}',  # unclosed at the end
]


@pytest.mark.parametrize("text", TEXTS)
def test_hermes_parser_stream_matches_whole(text):
    parser = get_tool_parser("hermes")
    content, calls = parser.parse(text)
    for size in (1, 3, 7, len(text)):
        st = parser.stream()
        got_text, got_calls = "", {}
        pieces = [text[k:k + size] for k in range(0, len(text), size)]
        for t, deltas in [st.feed(p) for p in pieces] + [st.finish()]:
            got_text += t
            for d in deltas:  # accumulated as a client does: name and id once, then argument fragments
                if d.id is not None:
                    assert d.index not in got_calls and d.name
                    got_calls[d.index] = [d.name, ""]
                got_calls[d.index][1] += d.arguments
        assert [tuple(v) for _, v in sorted(got_calls.items())] == [(c.name, c.arguments) for c in calls]
        assert (got_text.strip() or None) == (content.strip() if content else None)


def test_hermes_parser_streams_arguments_in_fragments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    st = get_tool_parser("hermes").stream()
    deltas = [d for ch in text for d in st.feed(ch)[1]] + st.finish()[1]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "") and first.id.startswith("call_")
    assert len(rest) > 10 and all(d.id is None and d.index == 0 for d in rest)
    assert "".join(d.arguments for d in rest) == '{"city": "Paris", "unit": "c"}' == HermesParser().parse(text)[1][0].arguments
    assert st.calls == 1


def test_parser_setting_auto_by_template_and_named():
    from kiln.config import ConfigError
    from kiln.serving.tool_parsers import tool_parser_for

    assert tool_parser_for("auto", CHAT_TEMPLATE).name == "hermes"  # the template writes <tool_call> blocks
    assert tool_parser_for("auto", None).name == tool_parser_for("hermes", "{{ messages }}").name == "hermes"
    with pytest.raises(ConfigError) as exc:
        tool_parser_for("llama9", CHAT_TEMPLATE)
    assert "serving.tool_call_parser" in str(exc.value) and "'hermes'" in str(exc.value) and "'auto'" in str(exc.value)


def test_unknown_parser_setting_fails_at_start_up(builtin_model_dir, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    kiln = Path(sys.executable).with_name("kiln")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_HOME"] = str(tmp_path)
    env["KILN_SERVING_TOOL_CALL_PARSER"] = "llama9"
    r = subprocess.run([str(kiln), "serve", "--model", str(builtin_model_dir), "--port", "0", "--no-training"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "serving.tool_call_parser = 'llama9'" in r.stderr and "'hermes'" in r.stderr


def test_hermes_parser_results():
    content, calls = HermesParser().parse(TEXTS[0])
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert HermesParser().parse(TEXTS[2]) == (TEXTS[2], [])
    with pytest.raises(ValueError):
        get_tool_parser("nope")


def test_forced_tool_parameters_with_local_refs(oai, server):
    """What pydantic emits for nested models (``$defs`` + ``$ref``) forces calls as it constrains
    ``response_format``: each tool's arguments are a JSON document of their own."""
    params = {"$defs": {"C": {"type": "object", "properties": {"n": {"enum": ["x", "y"]}}, "required": ["n"],
                              "additionalProperties": False}},
              "type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}, "required": ["c"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "w", "parameters": params}}]
    for choice in ("required", {"type": "function", "function": {"name": "w"}}):
        out = oai.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "Where?"}],
                                          tools=tools, tool_choice=choice, max_tokens=64, temperature=0)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c
        call = c.message.tool_calls[0].function
        assert call.name == "w"
        jsonschema.validate(json.loads(call.arguments), params)
