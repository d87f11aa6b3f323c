"""The diagnostic endpoints need the API key like every other route, and the recent-request log keeps
prompt and completion text only when ``server.debug_requests_text`` is set (real ``kiln serve``)."""

from __future__ import annotations

import httpx

from tests.security.conftest import API_KEY

KEY = {"Authorization": f"Bearer {API_KEY}"}


def test_debug_endpoints_need_the_key_and_text_is_kept_only_when_enabled(auth_server):
    base = auth_server.base_url
    for path in ("/v1/debug/requests", "/v1/debug/model-state"):
        r = httpx.get(f"{base}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", path
        assert httpx.get(f"{base}{path}", headers=KEY).status_code == 200, path
    prompt = "spell the word kiln"
    chat = httpx.post(f"{base}/v1/chat/completions", headers=KEY, timeout=60, json={
        "model": auth_server.model_id, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
        "temperature": 0})
    assert chat.status_code == 200, chat.text
    rid = chat.headers["x-kiln-request-id"]
    log = httpx.get(f"{base}/v1/debug/requests", headers=KEY).json()
    assert log["text"] is True and log["capacity"] == 2
    entry = next(e for e in log["requests"] if e["id"] == rid)
    assert prompt in entry["prompt_text"]  # the rendered chat prompt, template included
    assert entry["completion_texts"] == [chat.json()["choices"][0]["message"]["content"]]
