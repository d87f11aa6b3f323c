"""Completions as clients batch them: several prompts in one request (strings or token-ID
lists, ``n`` choices each, indexed ``p * n + i``), ``echo`` (with prompt logprobs), and
``suffix`` refused; through the official ``openai`` client, streaming and not."""

from __future__ import annotations

import openai
import pytest

PROMPTS = ["The river", "What is 3 + 4?", "Once upon"]


def complete(oai, server, prompt, **kw):
    return oai.completions.create(model=server.model_id, prompt=prompt, **kw)


def test_list_of_prompts_gives_n_choices_each_in_openai_order(oai, server):
    singles = [complete(oai, server, p, max_tokens=8, temperature=0).choices[0].text for p in PROMPTS]
    r = complete(oai, server, PROMPTS, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        assert c.text == singles[c.index // 2]
    one = complete(oai, server, PROMPTS[0], max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == sum(complete(oai, server, p, max_tokens=1).usage.prompt_tokens for p in PROMPTS)
    assert one.usage.prompt_tokens < r.usage.prompt_tokens


def test_list_of_token_id_prompts_and_streaming(oai, server):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    r = complete(oai, server, ids, max_tokens=6, temperature=0)
    assert len(r.choices) == 2
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for ev in complete(oai, server, ids, max_tokens=6, temperature=0, stream=True,
                       stream_options={"include_usage": True}):
        for c in ev.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = ev.usage or usage
    assert texts == {c.index: c.text for c in r.choices}
    assert reasons == {c.index: c.finish_reason for c in r.choices}
    assert usage.prompt_tokens == 7 and usage.completion_tokens == r.usage.completion_tokens


def test_echo_puts_the_prompt_first_with_its_logprobs(oai, server):
    plain = complete(oai, server, PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    r = complete(oai, server, PROMPTS[0], max_tokens=5, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text == PROMPTS[0] + plain.choices[0].text
    n_prompt = r.usage.prompt_tokens
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + len(plain.choices[0].logprobs.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[n_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n_prompt] == len(PROMPTS[0])
    assert all(len(d) == 2 for d in lp.top_logprobs[1:])
    # the same numbers as prompt_logprobs (vLLM's scoring field)
    scored = oai.completions.create(model=server.model_id, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 0}).model_dump()
    rows = scored["choices"][0]["prompt_logprobs"]
    actual = [None] + [next(iter(row.values()))["logprob"] for row in rows[1:]]
    assert lp.token_logprobs[0] is None and actual[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(actual[1:], abs=1e-5)


def test_echo_with_zero_tokens_and_several_prompts(oai, server):
    r = complete(oai, server, PROMPTS, max_tokens=0, echo=True)
    assert [c.text for c in r.choices] == PROMPTS


def test_echo_streaming_sends_the_prompt_first(oai, server):
    full = complete(oai, server, PROMPTS[1], max_tokens=6, temperature=0, echo=True).choices[0].text
    events = list(complete(oai, server, PROMPTS[1], max_tokens=6, temperature=0, echo=True, stream=True))
    assert events[0].choices[0].text == PROMPTS[1]
    assert "".join(e.choices[0].text for e in events if e.choices) == full


def test_suffix_is_refused_clearly(oai, server):
    with pytest.raises(openai.BadRequestError) as exc:
        complete(oai, server, "def f(", suffix="return 1", max_tokens=4)
    assert "suffix" in str(exc.value) and "infill" in str(exc.value)
    assert complete(oai, server, "x", suffix="", max_tokens=1).choices  # empty suffix changes nothing


def test_prompt_list_errors_name_the_prompt(http, server):
    r = http.post("/v1/completions", json={"model": server.model_id, "prompt": ["ok", ""]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    r = http.post("/v1/completions", json={"model": server.model_id, "prompt": [[1, 2], [10**7]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    assert http.post("/v1/completions", json={"model": server.model_id, "prompt": []}).status_code == 400
    assert http.post("/v1/completions", json={"model": server.model_id, "prompt": [[]]}).status_code == 400
