"""The OpenAI/vLLM surface real clients use, through the official ``openai`` client against a
real ``kiln serve``: sampling controls (penalties, logit bias, min_p, min_tokens,
stop_token_ids, bad_words), streaming and not."""

from __future__ import annotations

import pytest

PROMPT = "Tell me about the river."


def chat(oai, server, content=PROMPT, **kw):
    return oai.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": content}], **kw)


def streamed_text(stream) -> tuple[str, str | None]:
    text, reason = [], None
    for ev in stream:
        for c in ev.choices:
            text.append(c.delta.content or "")
            reason = c.finish_reason or reason
    return "".join(text), reason


@pytest.fixture(scope="module")
def hf(server):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    return tok, model


def _hf_greedy(hf, content: str, max_new: int, **gen_kw) -> str:
    import torch

    tok, model = hf
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             **gen_kw)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("penalty", [1.5, 0.8])
def test_repetition_penalty_greedy_matches_transformers(oai, server, hf, penalty):
    got = chat(oai, server, max_tokens=30, temperature=0, extra_body={"repetition_penalty": penalty})
    assert got.choices[0].message.content == _hf_greedy(hf, PROMPT, 30, repetition_penalty=penalty)


def test_logit_bias_and_bad_words_greedy_match_transformers(oai, server, hf):
    tok, _ = hf
    plain = chat(oai, server, max_tokens=12, temperature=0).choices[0].message.content
    first = tok(plain, add_special_tokens=False)["input_ids"][0]
    got = chat(oai, server, max_tokens=12, temperature=0, logit_bias={str(first): -100})
    assert got.choices[0].message.content == _hf_greedy(hf, PROMPT, 12, sequence_bias={(first,): -100.0})
    assert tok(got.choices[0].message.content, add_special_tokens=False)["input_ids"][:1] != [first]
    # streaming gives the same text
    text, reason = streamed_text(chat(oai, server, max_tokens=12, temperature=0, logit_bias={str(first): -100},
                                      stream=True))
    assert text == got.choices[0].message.content and reason == got.choices[0].finish_reason


def test_frequency_and_presence_penalties_change_greedy_output(oai, server):
    kw = dict(max_tokens=48, temperature=0, ignore_eos=True)
    base = oai.completions.create(model=server.model_id, prompt="the the the", extra_body=kw)
    pen = oai.completions.create(model=server.model_id, prompt="the the the", frequency_penalty=2.0,
                                 presence_penalty=2.0, extra_body=kw)
    words = lambda s: s.split()  # noqa: E731
    assert len(set(words(pen.choices[0].text))) >= len(set(words(base.choices[0].text)))
    assert pen.choices[0].text != base.choices[0].text


def test_min_tokens_and_stop_token_ids(oai, server, hf):
    tok, _ = hf
    short = chat(oai, server, max_tokens=200, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = chat(oai, server, max_tokens=n + 40, temperature=0, extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5
    # stop on the second token of the greedy answer: the text stops before it (vLLM default)
    ids = tok(short.choices[0].message.content, add_special_tokens=False)["input_ids"]
    stop_id = ids[1]
    r = chat(oai, server, max_tokens=40, temperature=0, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert stop_id not in tok(r.choices[0].message.content, add_special_tokens=False)["input_ids"]
    text, reason = streamed_text(chat(oai, server, max_tokens=40, temperature=0, stream=True,
                                      extra_body={"stop_token_ids": [stop_id]}))
    assert (text, reason) == (r.choices[0].message.content, "stop")


def test_min_p_and_sampling_controls_stream(oai, server):
    text, reason = streamed_text(chat(oai, server, max_tokens=16, temperature=1.0, seed=3, stream=True,
                                      extra_body={"min_p": 0.2, "repetition_penalty": 1.2}))
    again = chat(oai, server, max_tokens=16, temperature=1.0, seed=3, extra_body={"min_p": 0.2,
                                                                                   "repetition_penalty": 1.2})
    assert text == again.choices[0].message.content and reason == again.choices[0].finish_reason


@pytest.mark.parametrize(("extra", "param"), [
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"stop_token_ids": [10**8]}, "stop_token_ids"),
    ({"min_tokens": 50}, "min_tokens"),
])
def test_sampling_control_errors(http, server, extra, param):
    r = http.post("/v1/chat/completions", json={"model": server.model_id, "max_tokens": 10,
                                                "messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra", [{"logit_bias": {"1": 101}}, {"logit_bias": {"x": 1}}, {"repetition_penalty": 0},
                                   {"min_p": 1.5}, {"frequency_penalty": -3}])
def test_sampling_control_validation(http, server, extra):
    r = http.post("/v1/chat/completions", json={"model": server.model_id,
                                                "messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400
