"""Diagnostics over a real ``kiln serve`` (issue 35 item 6): per-phase latency histograms with fixed
label sets, training/adapter/eval metrics, the bounded recent-request log and the debug model-state
endpoint (on in ``ops_server``, off in the shared ``server``)."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from openai import OpenAI

from kiln.runtime.request_trace import PHASES
from tests.adapters.conftest import base_info, make_lora, upload_adapter  # noqa: F401  (fixtures)

STATES = ("queued", "running", "succeeded", "failed", "cancelled")


def _metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _chat(base: str, model: str, content: str = "hi", **headers) -> httpx.Response:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_phase_histograms_have_a_fixed_label_set_and_count_each_row(ops_server):
    base = ops_server.base_url
    before = _metrics(base)
    for phase in PHASES:  # every label is exposed before anything is observed in it
        assert f'kiln_request_phase_seconds_count{{phase="{phase}"}}' in before
    assert set(re.findall(r'phase="(\w+)"', " ".join(before))) == set(PHASES)
    _chat(base, ops_server.model_id)
    after = _metrics(base)
    for phase in ("queue_wait", "lock_wait", "prefill", "decode"):
        key = f'kiln_request_phase_seconds_count{{phase="{phase}"}}'
        assert after[key] == before[key] + 1, phase
    assert after['kiln_request_phase_seconds_sum{phase="decode"}'] > before['kiln_request_phase_seconds_sum{phase="decode"}']


def test_training_adapter_and_eval_metrics(ops_server, make_lora, tmp_path):  # noqa: F811
    base = ops_server.base_url
    before = _metrics(base)
    for state in STATES:
        assert f'kiln_training_jobs{{state="{state}"}}' in before and f'kiln_eval_runs{{state="{state}"}}' in before
    examples = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                for i in range(2)]
    r = httpx.post(f"{base}/v1/train/sft", timeout=60, json={
        "adapter": "diag-job", "examples": examples, "epochs": None, "until_learned": False, "max_steps": 2,
        "batch_size": 2})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 120
    while (job := httpx.get(f"{base}/v1/train/jobs/{job_id}").json())["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    assert job["state"] == "succeeded", job
    budget = httpx.get(f"{base}/health").json()["memory_budget"]
    assert [r for r in budget["reservations"] if r["kind"] == "training"] == []  # released on success

    rev = upload_adapter(base, "diag-lora", make_lora(seed=7), tmp_path)
    assert httpx.post(f"{base}/v1/adapters/diag-lora/load", timeout=60).status_code == 200
    assert httpx.post(f"{base}/v1/adapters/diag-lora/unload", timeout=60).status_code == 200
    upload_adapter(base, "diag-hot", make_lora(seed=8, scale=1e18), tmp_path)
    assert httpx.post(f"{base}/v1/adapters/diag-hot/load", timeout=60).status_code == 400  # canary fails
    after = _metrics(base)

    assert after['kiln_training_jobs{state="succeeded"}'] == before['kiln_training_jobs{state="succeeded"}'] + 1
    assert after['kiln_training_jobs{state="running"}'] == 0
    assert after["kiln_training_step_seconds_count"] >= before["kiln_training_step_seconds_count"] + 2
    assert after["kiln_training_tokens_per_second"] == 0  # no job runs now
    assert after['kiln_adapter_swaps_total{action="load"}'] == before['kiln_adapter_swaps_total{action="load"}'] + 1
    assert after['kiln_adapter_swaps_total{action="unload"}'] == before['kiln_adapter_swaps_total{action="unload"}'] + 1
    assert after["kiln_adapter_canary_failures_total"] == before["kiln_adapter_canary_failures_total"] + 1
    key = 'kiln_request_phase_seconds_count{phase="adapter_transition"}'
    assert after[key] == before[key] + 2  # the load and the unload (the refused load never swapped)
    assert rev


def test_recent_request_log_records_ids_timings_tokens_and_no_text(ops_server, make_lora, tmp_path):  # noqa: F811
    base, model = ops_server.base_url, ops_server.model_id
    secret = "a prompt the log must not keep"
    r = _chat(base, model, secret, **{"x-request-id": "diag-1"})
    assert r.headers["x-kiln-request-id"] == "diag-1"
    log = httpx.get(f"{base}/v1/debug/requests").json()
    assert log["capacity"] == 4 and log["text"] is False and secret not in str(log)
    entry = next(e for e in log["requests"] if e["id"] == "diag-1")
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert entry["route"] == "/v1/chat/completions" and entry["method"] == "POST" and entry["status"] == 200
    assert entry["model"] == model and entry["adapter"] is None and entry["adapter_revision"] is None
    assert entry["prompt_tokens"] == usage["prompt_tokens"] and entry["completion_tokens"] == usage["completion_tokens"]
    assert entry["finish_reasons"] == [choice["finish_reason"]] and entry["rows"] == 1
    assert set(entry["timings_s"]) == {"total", "queue_wait", "lock_wait", "prefill", "decode"}
    assert entry["timings_s"]["total"] >= entry["timings_s"]["decode"]

    # an adapter request names the revision that answered; a streamed one is recorded after its last event
    rev = upload_adapter(base, "diag-log", make_lora(seed=9), tmp_path)
    assert httpx.post(f"{base}/v1/adapters/diag-log/load", timeout=60).status_code == 200
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="diag-log", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=2, stream=True, extra_headers={"x-request-id": "diag-2"})
    finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    entry = next(e for e in httpx.get(f"{base}/v1/debug/requests").json()["requests"] if e["id"] == "diag-2")
    assert entry["adapter"] == entry["model"] == "diag-log" and entry["adapter_revision"] == rev
    assert entry["finish_reasons"] == finish and entry["completion_tokens"] >= 1
    assert httpx.post(f"{base}/v1/adapters/diag-log/unload", timeout=60).status_code == 200

    # bounded: the newest `capacity` entries; `limit` takes the newest few; a bad limit is 400
    for _ in range(5):
        _chat(base, model)
    log = httpx.get(f"{base}/v1/debug/requests").json()
    assert len(log["requests"]) == 4 and log["recorded"] >= 7
    assert all(e["id"] != "diag-1" for e in log["requests"])
    assert httpx.get(f"{base}/v1/debug/requests", params={"limit": 1}).json()["requests"] == log["requests"][-1:]
    bad = httpx.get(f"{base}/v1/debug/requests", params={"limit": 5})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_limit"


def test_debug_model_state(ops_server, make_lora, tmp_path):  # noqa: F811
    base = ops_server.base_url
    rev = upload_adapter(base, "diag-state", make_lora(seed=10), tmp_path)
    assert httpx.post(f"{base}/v1/adapters/diag-state/load", timeout=60).status_code == 200
    try:
        body = httpx.get(f"{base}/v1/debug/model-state").json()
        assert body["model"]["id"] == ops_server.model_id and body["model"]["parameters"]["bytes"] > 0
        assert body["adapters"]["wrapped"] is True
        assert body["adapters"]["served"]["diag-state"]["revision"] == rev
        assert any(k.startswith("diag-state@") for k in body["adapters"]["peft_adapters"])
        assert body["kv_cache"]["kv_blocks_total"] > 0 and body["engine"]["running"] is True
        assert [r["owner"] for r in body["memory_budget"]["reservations"]] == [f"diag-state@{rev}"]
        assert body["training"] == {"running_job": None}
    finally:
        assert httpx.post(f"{base}/v1/adapters/diag-state/unload", timeout=60).status_code == 200


@pytest.mark.parametrize("path, code", [("/v1/debug/requests", "debug_requests_disabled"),
                                        ("/v1/debug/model-state", "debug_model_state_disabled")])
def test_debug_endpoints_are_404_when_off(http, server, path, code):
    r = http.get(path)
    assert r.status_code == 404 and r.json()["error"]["code"] == code, r.text
    assert "x-kiln-request-id" not in _chat(server.base_url, server.model_id).headers
