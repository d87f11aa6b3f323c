"""Grammar resource bombs and constrained output that always validates (hardening round 3).

A counted-repetition regex once cost seconds of the event loop and ~200 MB that stayed: every
concurrent stream paused. Now grammars compile on their own thread under llguidance's limits and
a deadline, are probed before generation, and a grammar that gives up mid-way ends its choice
as an error, never as ``stop`` with invalid content. Real server, real openai client.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.security.streams import stream_gaps_while

BOMB = "(y{1000}){1000}"
MESSAGES = [{"role": "user", "content": "Say something."}]


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _post(srv, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/chat/completions", json={"model": srv.model_id, "messages": MESSAGES,
                                                                    "max_tokens": 8, **body}, timeout=60)


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": BOMB}, "guided_regex"),
    ({"guided_json": {"type": "string", "pattern": f"^{BOMB}$"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": f"^{BOMB}$"}}, "required": ["a"]}}}],
      "tool_choice": "required"}, None),
])
def test_grammar_that_cannot_complete_is_a_400_naming_the_limit(secure_server, extra, param):
    r = _post(secure_server, extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_too_complex" and err["param"] in (param, "tool_choice")
    assert "limit" in err["message"] or "admits no output" in err["message"]


def test_bombs_beside_a_stream_leave_its_pace_and_the_servers_memory(secure_server):
    """Six distinct bombs while streams run: no stream waits a second between tokens (the bomb once
    paused every stream 3-5 s) and the server's RSS grows by far less than one unbounded bomb (110-225 MB)."""
    srv = secure_server
    _post(srv, {"guided_regex": "[a-c]{2}"})  # warm the compiler once
    rss0 = _rss(srv.proc.pid)
    gaps, codes = stream_gaps_while(srv, lambda: [_post(srv, {"guided_regex": f"(y{{{1000 + i}}}){{1000}}"})
                                                  .status_code for i in range(6)])
    assert codes == [400] * 6
    assert gaps and max(gaps) < 1.0, f"a stream waited {max(gaps):.2f} s between chunks"
    grown = _rss(srv.proc.pid) - rss0
    assert grown < 100 << 20, f"RSS grew {grown >> 20} MiB over six refused bombs"


def _token_id(srv, text: str) -> int:
    r = httpx.post(f"{srv.base_url}/tokenize", json={"model": srv.model_id, "prompt": text,
                                                     "add_special_tokens": False}, timeout=30)
    ids = r.json()["tokens"]
    assert len(ids) == 1
    return ids[0]


def test_grammar_giving_up_mid_generation_is_an_error_finish_never_stop(secure_server):
    """The probe passes (``a`` is allowed for 40 tokens) but the model wants ``y``: the lexer hits its
    state limit after a few tokens. Non-streamed: a 400; streamed: an error event and ``finish_reason:
    "error"``. Never ``stop`` with a prefix that does not match."""
    srv = secure_server
    body = {"guided_regex": "a{0,40}" + BOMB, "logit_bias": {str(_token_id(srv, "y")): 100}, "max_tokens": 32}
    r = _post(srv, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_too_complex", r.text
    events, reasons = [], []
    with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", timeout=60,
                      json={"model": srv.model_id, "messages": MESSAGES, "stream": True, **body}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                events.append(ev)
                reasons += [c["finish_reason"] for c in ev.get("choices", []) if c.get("finish_reason")]
    assert any("error" in ev and ev["error"]["code"] == "grammar_too_complex" for ev in events), [json.dumps(e)[-200:] for e in events]
    assert reasons == ["error"]


def test_grammar_preparation_is_in_metrics_by_outcome(secure_server):
    """/metrics kiln_grammar_compile_seconds{outcome}: a fixed label set (compiled, cached, refused, ...)."""
    import re

    srv = secure_server

    def count(outcome: str) -> float:
        text = httpx.get(f"{srv.base_url}/metrics").text
        m = re.search(rf'kiln_grammar_compile_seconds_count{{outcome="{outcome}"}} ([0-9.e+]+)', text)
        assert m, text[-2000:]
        return float(m.group(1))

    before = {o: count(o) for o in ("compiled", "cached", "refused", "timeout", "busy")}
    regex = "[a-c]{2}x[0-9]{3}"  # a grammar no other test uses
    assert _post(srv, {"guided_regex": regex}).status_code == 200
    assert _post(srv, {"guided_regex": regex}).status_code == 200
    assert _post(srv, {"guided_regex": "(y{1000}){999}"}).status_code == 400
    assert count("compiled") == before["compiled"] + 1
    assert count("cached") == before["cached"] + 1
    assert count("refused") == before["refused"] + 1
    assert count("timeout") == before["timeout"] and count("busy") == before["busy"]
