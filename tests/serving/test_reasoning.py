"""Reasoning parsers and chat-template kwargs on real tokenizers (Qwen3; DeepSeek V3 with an R1-style prompt).

The parsers split an answer into ``reasoning_content`` and ``content``; a stream yields the same parts in
pieces. They are checked on text decoded token by token from each family's real tokenizer (Qwen3 holds
``<think>`` as one added token, DeepSeek's tokenizer spells it in text pieces), and end to end on tiny
random models: a prompt that leaves the span open (the R1-style generation prompt ``<think>\\n``) makes
the whole random answer reasoning, and Qwen3's ``enable_thinking: false`` renders its closed empty span.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from kiln.serving.reasoning import (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, check_reasoning_parser_setting,
                                    reasoning_parser_for)
from tests.realtok import real_model_dir, real_tokenizer_dir
from tests.serving.conftest import start_server, stop_server

MESSAGES = [{"role": "user", "content": "Is 7 prime?"}]
V3_GENERATION_PROMPT = "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"


def _template(family: str) -> str:
    return json.loads((real_tokenizer_dir(family) / "tokenizer_config.json").read_text("utf-8"))["chat_template"]


def r1_template() -> str:
    """DeepSeek V3's real template with the R1 generation prompt: the assistant turn opens ``<think>\\n``."""
    template = _template("deepseek_v3")
    assert V3_GENERATION_PROMPT in template
    return template.replace(V3_GENERATION_PROMPT, V3_GENERATION_PROMPT.replace("<｜Assistant｜>",
                                                                                "<｜Assistant｜><think>\\n"))


def _stream_split(parser, text: str, opened: bool, sizes) -> tuple[str | None, str | None]:
    st = parser.stream(opened)
    r, c = "", ""
    pos = 0
    for size in sizes:
        a, b = st.feed(text[pos:pos + size])
        r, c, pos = r + a, c + b, pos + size
    a, b = st.finish()
    return (r + a) or None, (c + b) or None


CASES = [  # (text, opened) -> (reasoning, content) for qwen3
    (("<think>\nLet me see.\n7 has no divisors.\n</think>\n\nYes.", False), ("Let me see.\n7 has no divisors.", "Yes.")),
    (("<think>\n\n</think>\n\nYes.", False), (None, "Yes.")),
    (("Yes, <think> is a tag.", False), (None, "Yes, <think> is a tag.")),
    (("  <think>cut short", False), ("cut short", None)),
    (("still thinking\n</think>\n\nYes.", True), ("still thinking", "Yes.")),
    (("</thin", True), ("</thin", None)),
    (("", False), (None, None)),
]


@pytest.mark.parametrize(("case", "expected"), CASES)
def test_split_whole_and_streamed_agree(case, expected):
    text, opened = case
    parser = Qwen3ReasoningParser()
    assert parser.split(text, opened) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        sizes = [rng.randint(1, 4) for _ in range(len(text) + 1)]
        assert _stream_split(parser, text, opened, sizes) == expected


def test_deepseek_r1_starts_inside_the_span_unless_the_prompt_closed_it():
    p = DeepSeekR1ReasoningParser()
    assert p.opened_by("<｜User｜>hi<｜Assistant｜>") and p.opened_by("<｜Assistant｜><think>\n")
    assert not p.opened_by("<｜Assistant｜><think>\n\n</think>\n\n")
    assert p.split("no closing tag", True) == ("no closing tag", None)
    q = Qwen3ReasoningParser()
    assert not q.opened_by("<|im_start|>assistant\n") and q.opened_by("<|im_start|>assistant\n<think>\n")
    assert not q.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_split_of_real_token_decoding(family):
    """The answer a template-trained model writes, tokenized by the family's tokenizer and decoded one token
    at a time as the engine streams it, splits into the same parts whole and streamed."""
    from transformers import AutoTokenizer

    from kiln.runtime.textstream import TextStream

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir(family))
    text = "<think>\nPrüfe: 7 ÷ 2, 7 ÷ 3 — kein Teiler 🙂.\n</think>\n\n7 ist eine Primzahl."
    ids = tok.encode(text, add_special_tokens=False)
    if family == "qwen3":
        assert tok.convert_tokens_to_ids("<think>") in ids and tok.convert_tokens_to_ids("</think>") in ids
    else:
        assert len(tok.encode("</think>", add_special_tokens=False)) > 1  # text pieces, not one token
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    parser = Qwen3ReasoningParser() if family == "qwen3" else DeepSeekR1ReasoningParser()
    expected = ("Prüfe: 7 ÷ 2, 7 ÷ 3 — kein Teiler 🙂.", "7 ist eine Primzahl.")
    assert parser.split(text, False) == expected
    st = parser.stream(False)
    parts = [st.feed(p) for p in pieces] + [st.finish()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected


def test_auto_picks_by_template_family_and_unknown_names_fail():
    from kiln.config import ConfigError

    assert reasoning_parser_for("auto", _template("qwen3")).name == "qwen3"
    assert reasoning_parser_for("auto", r1_template()).name == "deepseek_r1"
    assert reasoning_parser_for("auto", _template("deepseek_v3")) is None  # V3 writes no reasoning span
    assert reasoning_parser_for("auto", _template("llama3_1")) is None
    assert reasoning_parser_for("none", _template("qwen3")) is None
    assert reasoning_parser_for("deepseek_r1", None).name == "deepseek_r1"
    with pytest.raises(ConfigError) as exc:
        check_reasoning_parser_setting("qwen9")
    assert "serving.reasoning_parser" in str(exc.value) and "'deepseek_r1'" in str(exc.value)


def test_unknown_reasoning_parser_stops_start_up(builtin_model_dir, tmp_path):
    kiln = Path(sys.executable).with_name("kiln")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_HOME=str(tmp_path), KILN_SERVING_REASONING_PARSER="qwen9")
    r = subprocess.run([str(kiln), "serve", "--model", str(builtin_model_dir), "--port", "0", "--no-training"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "serving.reasoning_parser = 'qwen9'" in r.stderr


def test_training_examples_render_reasoning_content_through_the_template():
    """An SFT example's ``reasoning_content`` reaches Qwen3's template, and its tokens are the assistant's."""
    from transformers import AutoTokenizer

    from kiln.training.schemas import SFTExample
    from kiln.training.core.templates import assistant_tokens

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir("qwen3"))
    ex = SFTExample(messages=[{"role": "user", "content": "Is 7 prime?"},
                              {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisors."}])
    ids, mask = assistant_tokens(tok, [m.model_dump() for m in ex.messages], end_ids={tok.eos_token_id})
    learnt = tok.decode([t for t, m in zip(ids, mask) if m])
    assert learnt == "<think>\n7 has no divisors.\n</think>\n\nYes.<|im_end|>"
    plain = SFTExample(messages=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
    assert "reasoning_content" not in plain.model_dump()["messages"][1]  # unset: recipes unchanged
    with pytest.raises(ValueError):
        SFTExample(messages=[{"role": "user", "content": "Q", "reasoning_content": "r"},
                             {"role": "assistant", "content": "A"}])


# -- served -----------------------------------------------------------------------------------------------


R1_DEFAULT_BUDGET = 6


def _serve(model: Path, tmp_path_factory, name: str, env: dict[str, str] | None = None):
    home = tmp_path_factory.mktemp(name)
    return start_server(model, home, extra_args=["--no-training", "--max-model-len", "2048"], env_extra=env or {},
                        config=None)


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    srv = _serve(real_model_dir("qwen3"), tmp_path_factory, "reason-qwen3")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory):
    srv = _serve(real_model_dir("deepseek_v3", chat_template=r1_template(), tag="r1"), tmp_path_factory,
                 "reason-r1", {"KILN_SERVING_THINKING_TOKEN_BUDGET": str(R1_DEFAULT_BUDGET)})
    yield srv
    stop_server(srv)


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _raw(srv, messages, **kw) -> str:
    """The unparsed answer: the same prompt tokens through /v1/completions."""
    ids = httpx.post(f"{srv.base_url}/tokenize", json={"model": srv.model_id, "messages": messages, **kw.pop(
        "tokenize_extra", {})}, timeout=60).json()["tokens"]
    r = httpx.post(f"{srv.base_url}/v1/completions", json={"model": srv.model_id, "prompt": ids, **kw}, timeout=120)
    return r.json()["choices"][0]["text"]


def test_open_span_makes_the_answer_reasoning_stream_and_whole(r1_server):
    """The R1-style prompt opens ``<think>``: a random model never closes it, so with an unlimited budget
    (JSON null) its whole answer is reasoning, read by the official client through ``model_extra`` and
    streamed as ``delta.reasoning_content``."""
    client = _client(r1_server)
    kw = dict(model=r1_server.model_id, messages=MESSAGES, max_tokens=24, temperature=0,
              extra_body={"thinking_token_budget": None})
    whole = client.chat.completions.create(**kw).choices[0]
    raw = _raw(r1_server, MESSAGES, max_tokens=24, temperature=0)
    assert whole.message.model_extra["reasoning_content"] == raw.strip("\n") and raw.strip("\n")
    assert whole.message.content is None
    streamed_r, streamed_c = "", ""
    for ev in client.chat.completions.create(**kw, stream=True):
        d = ev.choices[0].delta
        streamed_r += (d.model_extra or {}).get("reasoning_content") or ""
        streamed_c += d.content or ""
    assert (streamed_r, streamed_c) == (whole.message.model_extra["reasoning_content"], "")


def test_enable_thinking_false_renders_the_closed_span(qwen3_server):
    """``chat_template_kwargs`` reaches the template: Qwen3's no-thinking prompt ends with an empty, closed
    span, so the random answer is all content (as the same tokens' raw completion)."""
    base = {"model": qwen3_server.model_id, "messages": MESSAGES}
    default = httpx.post(f"{qwen3_server.base_url}/tokenize", json=base, timeout=60).json()
    off = httpx.post(f"{qwen3_server.base_url}/tokenize",
                     json={**base, "chat_template_kwargs": {"enable_thinking": False}, "return_token_strs": True},
                     timeout=60).json()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_server.model_dir)
    assert tok.decode(off["tokens"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(default["tokens"]).endswith("<|im_start|>assistant\n")
    client = _client(qwen3_server)
    r = client.chat.completions.create(model=qwen3_server.model_id, messages=MESSAGES, max_tokens=16, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    raw = _raw(qwen3_server, MESSAGES, max_tokens=16, temperature=0,
               tokenize_extra={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.model_extra["reasoning_content"] is None
    assert r.choices[0].message.content == raw


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"add_generation_prompt": False}, "server sets them itself"),
    ({f"k{i}": True for i in range(17)}, "chat_template_kwargs"),
    ({"enable_thinking": {"nested": 1}}, "chat_template_kwargs"),
    ({"bad name": 1}, "chat_template_kwargs"),
])
def test_bad_chat_template_kwargs_are_400(qwen3_server, kwargs, fragment):
    r = httpx.post(f"{qwen3_server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": qwen3_server.model_id, "messages": MESSAGES, "max_tokens": 2,
                         "chat_template_kwargs": kwargs})
    assert r.status_code == 400 and fragment in r.text, r.text


def test_assistant_reasoning_content_goes_back_through_the_template(qwen3_server):
    history = [*MESSAGES, {"role": "assistant", "content": "Yes.", "reasoning_content": "No divisors."},
               {"role": "user", "content": "And 9?"}, {"role": "assistant", "content": "No.",
                                                         "reasoning_content": "9 = 3 x 3."}]
    r = httpx.post(f"{qwen3_server.base_url}/tokenize", timeout=60,
                   json={"model": qwen3_server.model_id, "messages": history, "add_generation_prompt": False})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_server.model_dir)
    text = tok.decode(r.json()["tokens"])
    assert "<think>\n9 = 3 x 3.\n</think>\n\nNo." in text  # the last turn shows its reasoning, as the template says
    bad = httpx.post(f"{qwen3_server.base_url}/v1/chat/completions", timeout=60,
                     json={"model": qwen3_server.model_id, "max_tokens": 2,
                           "messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]})
    assert bad.status_code == 400


@pytest.mark.parametrize("budget", [None, 2])  # None: omitted, the server default applies
def test_thinking_budget_closes_the_span_and_the_answer_follows(r1_server, budget):
    client = _client(r1_server)
    n = R1_DEFAULT_BUDGET if budget is None else budget
    extra = {} if budget is None else {"extra_body": {"thinking_token_budget": budget}}
    kw = dict(model=r1_server.model_id, messages=MESSAGES, max_tokens=n + 20, temperature=0, **extra)
    whole = client.chat.completions.create(**kw).choices[0]
    raw = _raw(r1_server, MESSAGES, max_tokens=n, temperature=0)  # the model's own first n tokens
    assert whole.message.model_extra["reasoning_content"] == (raw.strip("\n") or None)
    assert whole.message.content  # the answer continues after the closing sequence
    streamed_r, streamed_c = "", ""
    for ev in client.chat.completions.create(**kw, stream=True):
        d = ev.choices[0].delta
        streamed_r += (d.model_extra or {}).get("reasoning_content") or ""
        streamed_c += d.content or ""
    assert (streamed_r or None, streamed_c) == (whole.message.model_extra["reasoning_content"], whole.message.content)


def test_forced_tool_call_after_budgeted_reasoning(r1_server):
    """The forcing grammar starts where the answer does: reasoning first, then a parsed, valid call."""
    import jsonschema

    tool = {"type": "function", "function": {"name": "is_prime", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}}
    r = _client(r1_server).chat.completions.create(
        model=r1_server.model_id, messages=MESSAGES, tools=[tool], tool_choice="required", parallel_tool_calls=False,
        max_tokens=80, temperature=0, extra_body={"thinking_token_budget": 3})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.model_extra["reasoning_content"]
    call = c.message.tool_calls[0]
    assert call.function.name == "is_prime"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_budget_without_a_reasoning_parser_is_400(http, server):
    r = http.post("/v1/chat/completions", json={"model": server.model_id, "messages": MESSAGES, "max_tokens": 2,
                                                "thinking_token_budget": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    ok = http.post("/v1/chat/completions", json={"model": server.model_id, "messages": MESSAGES, "max_tokens": 2,
                                                 "thinking_token_budget": None})
    assert ok.status_code == 200
    neg = http.post("/v1/chat/completions", json={"model": server.model_id, "messages": MESSAGES, "max_tokens": 2,
                                                  "thinking_token_budget": -1})
    assert neg.status_code == 400


def test_tool_calls_are_read_from_the_content_part():
    from kiln.serving.tool_parsers import get_tool_parser

    text = ('<think>\nThe user wants <tool_call> syntax? No, a call.\n</think>\n\n'
            '<tool_call>\n{"name": "is_prime", "arguments": {"n": 7}}\n</tool_call>')
    reasoning, content = Qwen3ReasoningParser().split(text, False)
    assert reasoning == "The user wants <tool_call> syntax? No, a call."
    rest, calls = get_tool_parser("hermes").parse(content)
    assert rest is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("is_prime", {"n": 7})]
