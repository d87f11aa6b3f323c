"""Limits are checked before the work they bound (hardening round 3, item 4).

100,000 one-character messages were validated and rendered (2 s of the event loop) before
``limit_exceeded``; a 3.9 MB emoji prompt was tokenized in full (16 s of CPU) before
``context_length_exceeded``. Now the message count is checked on the parsed JSON before
validation, big bodies are parsed off the event loop, and a prompt whose bytes alone prove it
longer than the context is refused without being tokenized. Real server, beside a live stream.
"""

from __future__ import annotations

import httpx

from tests.security.streams import stream_gaps_while


def test_message_count_is_refused_before_validation(secure_server):
    srv = secure_server
    body = {"model": srv.model_id, "messages": [{"role": "user", "content": "x"}] * 100_000, "max_tokens": 4}
    gaps, r = stream_gaps_while(srv, lambda: httpx.post(f"{srv.base_url}/v1/chat/completions", json=body,
                                                         timeout=60))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "limit_exceeded" and err["param"] == "messages" and "max_messages" in err["message"]
    assert gaps and max(gaps) < 1.0, f"a stream waited {max(gaps):.2f} s between chunks"


def test_prompt_certainly_over_the_context_is_not_tokenized(secure_server):
    srv = secure_server
    emoji = "\U0001F600" * 950_000  # 3.8 MB of UTF-8, under the 4 MiB body limit
    for path, body in (("/v1/completions", {"prompt": emoji}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": emoji}]})):
        gaps, r = stream_gaps_while(srv, lambda: httpx.post(f"{srv.base_url}{path}", timeout=60,
                                                             json={"model": srv.model_id, "max_tokens": 4, **body}))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err
        assert gaps and max(gaps) < 1.0, f"{path}: a stream waited {max(gaps):.2f} s between chunks"
    # just over the limit, but not provably so from the bytes: tokenized and refused with the exact count
    r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                   json={"model": srv.model_id, "max_tokens": 4, "prompt": "sky " * 400})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
