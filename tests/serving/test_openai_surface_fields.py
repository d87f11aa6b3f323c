"""OpenAI request fields that change nothing on a self-hosted model are accepted and ignored
(named in ``x-kiln-ignored-fields``, logged once); typos and fields that would change the
output stay 400s; ``stream_options`` only with ``stream``."""

from __future__ import annotations

import openai
import pytest

IGNORABLE = {"store": True, "metadata": {"job": "nightly"}, "user": "u-1", "service_tier": "auto",
             "prediction": {"type": "content", "content": ""}, "safety_identifier": "s", "prompt_cache_key": "k"}


def test_ignored_fields_are_named_in_a_header_streaming_and_not(oai, server):
    msgs = [{"role": "user", "content": "hi"}]
    raw = oai.chat.completions.with_raw_response.create(
        model=server.model_id, messages=msgs, max_tokens=3, temperature=0, store=True, metadata={"a": "b"},
        user="me", service_tier="auto", prediction={"type": "content", "content": ""})
    assert set(raw.headers["x-kiln-ignored-fields"].split(",")) == {"store", "metadata", "user", "service_tier",
                                                                   "prediction"}
    plain = oai.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=3, temperature=0)
    assert raw.parse().choices[0].message.content == plain.choices[0].message.content
    with oai.chat.completions.with_streaming_response.create(
            model=server.model_id, messages=msgs, max_tokens=3, stream=True, store=False,
            stream_options={"include_usage": True}) as resp:
        assert resp.headers["x-kiln-ignored-fields"] == "store"
        events = list(resp.parse())
    assert events[-1].usage is not None and events[-1].usage.completion_tokens >= 1
    raw = oai.completions.with_raw_response.create(model=server.model_id, prompt="hi", max_tokens=2, user="x",
                                                   extra_body={"metadata": {"k": "v"}})
    assert raw.headers["x-kiln-ignored-fields"] == "metadata,user"
    assert "x-kiln-ignored-fields" not in oai.completions.with_raw_response.create(
        model=server.model_id, prompt="hi", max_tokens=2).headers


def test_ignored_fields_are_logged(oai, server):
    oai.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                extra_body={"safety_identifier": "abc", "prompt_cache_key": "p"})
    log = server.log()
    assert "accepted and ignored OpenAI request fields" in log and "safety_identifier" in log


@pytest.mark.parametrize("extra", [
    {"stroe": True},  # a typo stays an error
    {"prediction": {"type": "content", "content": "draft answer"}},
    {"service_tier": "platinum"},
    {"metadata": {f"k{i}": "v" for i in range(17)}},
    {"stream_options": {"include_usage": True}},  # without stream
    {"stream_options": {"continuous_usage_stats": True}, "stream": True},
])
def test_fields_that_would_matter_or_are_wrong_stay_400(oai, server, extra):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=1, extra_body=extra)
    assert exc.value.status_code == 400
    if "prediction" in extra:
        assert "not supported" in str(exc.value)
