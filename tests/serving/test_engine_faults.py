"""Issue 45 item 3 against a real ``kiln serve``: with ``KILN_ENGINE_FAULT=forward_raises:<marker>``, the
request whose prompt holds the marker gets a typed error while 8 streams beside it finish and
``/health`` stays ok (the failure is contained to its row, kiln.runtime.cycle_faults)."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from tests.serving.conftest import start_server, stop_server

MARK = "POISON"
STREAMS = 8
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def faulty(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-faults")
    srv = start_server(builtin_model_dir, home, extra_args=["--no-training"],
                       env_extra={"KILN_ENGINE_FAULT": f"forward_raises:{MARK}"}, config=None)
    yield srv
    stop_server(srv)


def test_a_forward_failing_for_one_request_fails_it_alone(faulty):
    client = openai.OpenAI(base_url=f"{faulty.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(STREAMS + 2)

    def stream(i: int) -> None:
        try:
            start.wait(30)
            parts, reason = [], None
            for chunk in client.chat.completions.create(
                    model=faulty.model_id, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                    max_tokens=NEW_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    reason = chunk.choices[0].finish_reason or reason
            texts[i], reasons[i] = "".join(parts), reason
        except BaseException as exc:  # reported below
            errors.append(exc)

    poisoned: dict[str, object] = {}

    def poison() -> None:
        start.wait(30)
        try:
            client.chat.completions.create(model=faulty.model_id, max_tokens=NEW_TOKENS,
                                           messages=[{"role": "user", "content": f"Say {MARK}."}])
        except openai.APIStatusError as exc:
            poisoned["status"], poisoned["body"] = exc.status_code, exc.body

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)] + [threading.Thread(target=poison)]
    for t in threads:
        t.start()
    start.wait(30)
    for t in threads:
        t.join(120)
    assert errors == []
    assert sorted(reasons) == list(range(STREAMS)) and set(reasons.values()) == {"length"}
    assert all(texts[i] for i in range(STREAMS))
    assert poisoned["status"] == 500
    assert poisoned["body"]["code"] == "engine_row_failed" and "forward_error" in poisoned["body"]["message"]

    health = httpx.get(f"{faulty.base_url}/health", timeout=10)
    body = health.json()
    assert health.status_code == 200 and body["status"] == "ok"
    assert body["restart_required"] is None and body["engine_faults"]["forward_error"] >= 1
    assert body["engine_error"] is None

    # a poisoned stream ends with a typed error event; the server still answers the next request
    with httpx.stream("POST", f"{faulty.base_url}/v1/chat/completions", timeout=60, json={
            "model": faulty.model_id, "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"{MARK}!"}]}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert any('"engine_row_failed"' in e for e in events) and events[-1] == "data: [DONE]"
    ok = client.chat.completions.create(model=faulty.model_id, max_tokens=4,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].finish_reason in ("stop", "length")


def _faults_total(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^kiln_engine_faults_total\{class="(\w+)"\} (\S+)$', text, re.MULTILINE)}


def test_contained_faults_are_counted_by_class_in_metrics(faulty):
    before = _faults_total(faulty.base_url)
    assert set(before) == {"forward_error", "out_of_memory", "unknown_state"}
    client = openai.OpenAI(base_url=f"{faulty.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=faulty.model_id, max_tokens=4,
                                       messages=[{"role": "user", "content": f"{MARK} again"}])
    after = _faults_total(faulty.base_url)
    assert after["forward_error"] >= before["forward_error"] + 1
    assert after["out_of_memory"] == before["out_of_memory"] and after["unknown_state"] == 0
