"""The official ``openai`` client against a real ``kiln serve`` subprocess."""

from __future__ import annotations

import time

import httpx
import pytest

PROMPTS = [
    "What is the capital of France?",
    "What is 3 + 4?",
    "Tell me about the river.",
]


def chat(oai, server, content, **kw):
    return oai.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": content}], **kw
    )


def test_chat_basic(oai, server):
    r = chat(oai, server, PROMPTS[0], max_tokens=32, temperature=0)
    assert r.object == "chat.completion"
    assert r.model == server.model_id
    assert r.system_fingerprint.startswith("kiln-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_adapter_revision_header_is_base(oai, server):
    raw = oai.chat.completions.with_raw_response.create(
        model=server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.headers["x-kiln-adapter-revision"] == "base"


def test_greedy_matches_transformers_generate(oai, server):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    for content in PROMPTS:
        enc = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=True, return_tensors="pt")
        ids = enc["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        got = chat(oai, server, content, max_tokens=40, temperature=0)
        assert got.choices[0].message.content == expected, content


def test_streaming_assembles_same_text(oai, server):
    full = chat(oai, server, PROMPTS[0], max_tokens=24, temperature=0).choices[0].message.content
    stream = chat(oai, server, PROMPTS[0], max_tokens=24, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for event in stream:
        if event.usage is not None:
            usage = event.usage
        for c in event.choices:
            assert c.index == 0
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert "".join(pieces) == full
    assert len(reasons) == 1
    assert usage is not None and usage.completion_tokens >= 1


def test_stream_ends_with_done(http, server):
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_n_choices(oai, server):
    r = chat(oai, server, PROMPTS[2], max_tokens=12, temperature=1.5, seed=3, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content is not None for c in r.choices)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert 3 <= r.usage.completion_tokens <= 3 * 12


def test_n_choices_stream_indices(oai, server):
    stream = chat(oai, server, PROMPTS[1], max_tokens=8, temperature=1.0, n=2, stream=True)
    finished = set()
    for event in stream:
        for c in event.choices:
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}


def test_stop_sequence_trims_output(oai, server):
    full = chat(oai, server, PROMPTS[0], max_tokens=40, temperature=0).choices[0].message.content
    assert len(full) > 12
    stop = full[8:11]
    cut = full.index(stop)
    r = chat(oai, server, PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "zzzz-never"])
    assert r.choices[0].message.content == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    # the same cut when streaming
    s = chat(oai, server, PROMPTS[0], max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(c.delta.content or "" for e in s for c in e.choices) == full[:cut]


def test_seeded_sampling_is_reproducible(oai, server):
    kw = dict(max_tokens=24, temperature=2.0, top_p=0.95)
    a = [chat(oai, server, PROMPTS[2], seed=s, **kw).choices[0].message.content for s in (11, 12, 13)]
    b = [chat(oai, server, PROMPTS[2], seed=s, **kw).choices[0].message.content for s in (11, 12, 13)]
    assert a == b
    assert len(set(a)) > 1, "different seeds should give different samples at temperature 2"


def test_chat_logprobs(oai, server):
    r = chat(oai, server, PROMPTS[0], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_completions_text(oai, server):
    r = oai.completions.create(model=server.model_id, prompt="The capital of France is", max_tokens=8,
                               temperature=0, logprobs=2)
    assert r.object == "text_completion"
    assert r.system_fingerprint.startswith("kiln-")
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens


def test_models_lists_base(oai, server):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [server.model_id]


def test_disconnect_mid_stream_frees_rows(server):
    body = {"model": server.model_id, "messages": [{"role": "user", "content": PROMPTS[2]}],
            "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        before = _generated_tokens(client)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert client.get("/health").json()["active_rows"] >= 1
        # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 20
        health = client.get("/health").json()
        while health["active_rows"] != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            health = client.get("/health").json()
        assert health["active_rows"] == 0
        assert health["queued_rows"] == 0
        metrics = client.get("/metrics").text
        assert "kiln_active_rows 0.0" in metrics
        assert _generated_tokens(client) - before < 450, "the row ran to the end instead of being cancelled"


def _generated_tokens(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kiln_generated_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("kiln_generated_tokens_total missing from /metrics")


def test_completions_streaming_matches_non_streaming(oai, server):
    kw = dict(model=server.model_id, prompt="The capital of France is", max_tokens=12, temperature=0)
    full = oai.completions.create(**kw).choices[0].text
    events = list(oai.completions.create(stream=True, **kw))
    assert "".join(c.text for e in events for c in e.choices) == full
    assert [c.finish_reason for e in events for c in e.choices if c.finish_reason] in (["length"], ["stop"])
    assert all(e.system_fingerprint and e.system_fingerprint.startswith("kiln-") for e in events)


# -- error conformance: each caller mistake raises the class an OpenAI user catches --------

@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda oai, s: chat(oai, s, "hi", temperature=-2), "temperature"),
        (lambda oai, s: chat(oai, s, "hi", max_tokens=-1), "max_tokens"),
        (lambda oai, s: chat(oai, s, "hi", n=10_000), None),
        (lambda oai, s: oai.completions.create(model=s.model_id, prompt=[-1]), None),
        (lambda oai, s: oai.chat.completions.create(model=s.model_id, messages=[]), "messages"),
    ],
    ids=["temperature", "max_tokens", "n_limit", "token_id", "no_messages"],
)
def test_invalid_requests_raise_bad_request(oai, server, call, param):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        call(oai, server)
    err = info.value.body
    assert info.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["message"] and err["code"]
    if param is not None:
        assert err["param"] == param


def test_unknown_model_raises_not_found(oai, server):
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="hi")
