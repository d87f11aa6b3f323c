"""Structured output through the official ``openai`` client: ``response_format`` json_object and
json_schema (strict), and vLLM's ``guided_json``/``guided_regex``/``guided_choice``, streaming and
not, on both routes; the output parses and validates whenever the choice ends with ``stop``."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_json_schema_chat_outputs_validate(oai, server):
    r = oai.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=120, temperature=1.0,
                                    seed=7, n=4, response_format=_schema_format())
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_schema_streamed_matches_and_validates(oai, server):
    kw = dict(model=server.model_id, messages=MESSAGES, max_tokens=120, temperature=0,
              response_format=_schema_format())
    full = oai.chat.completions.create(**kw).choices[0]
    text, reason = "", None
    for ev in oai.chat.completions.create(stream=True, **kw):
        for c in ev.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    assert (text, reason) == (full.message.content, full.finish_reason) and reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(oai, server):
    r = oai.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=200, temperature=0.8,
                                    seed=1, n=3, response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":  # an open-ended object may reach max_tokens first
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.message.content.startswith("{")


def test_vllm_guided_extras_on_completions(oai, server):
    r = oai.completions.create(model=server.model_id, prompt=["The answer is", "Pick one:"], max_tokens=40,
                               temperature=1.0, seed=3, n=2, extra_body={"guided_choice": ["yes", "no", "not sure"]})
    assert len(r.choices) == 4 and all(c.text in ("yes", "no", "not sure") for c in r.choices)
    r = oai.completions.create(model=server.model_id, prompt="Code:", max_tokens=40, temperature=1.0, seed=2,
                               extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2,4}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    text = "".join(ev.choices[0].text for ev in oai.completions.create(
        model=server.model_id, prompt="Data:", max_tokens=120, temperature=0, stream=True,
        extra_body={"guided_json": json.dumps(SCHEMA)}) if ev.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_text_format_changes_nothing(oai, server):
    a = oai.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=10, temperature=0)
    b = oai.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=10, temperature=0,
                                    response_format={"type": "text"})
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"guided_regex": "["}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
])
def test_structured_output_errors(oai, server, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert exc.value.body["param"] == param


def test_a_grammar_that_bad_words_exclude_entirely_is_no_valid_output(oai, server):
    """Issue 45 item 9: ``guided_choice: ["a"]`` with ``bad_words: ["a"]`` exclude every token between them: a
    400 ``no_valid_output`` naming ``bad_words``, not ``grammar_too_complex`` (a resource limit)."""
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=server.model_id, prompt="Pick:", max_tokens=5,
                               extra_body={"guided_choice": ["a"], "bad_words": ["a"]})
    body = exc.value.body
    assert body["code"] == "no_valid_output" and body["param"] == "bad_words", body
    assert "guided_choice and bad_words" in body["message"]
    ok = oai.completions.create(model=server.model_id, prompt="Pick:", max_tokens=5, temperature=0,
                                extra_body={"guided_choice": ["a", "b"], "bad_words": ["a"]})
    assert ok.choices[0].text == "b"
