"""Raw HTTP against a real ``kiln serve``: scoring, every error case, ops endpoints, config precedence."""

from __future__ import annotations

import pytest
from tests.conftest import default_device


def assert_error(r, status: int, code: str | None = None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code", "hint"}
    assert body["error"]["message"] and body["error"]["type"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# -- prompt_logprobs --------------------------------------------------------------


@pytest.fixture(scope="module")
def direct_model(server):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_logprobs_match_direct_forward(http, server, direct_model, k):
    import torch

    prompt = [17, 250, 31, 99, 4, 300, 12, 12, 77, 2]
    r = http.post("/v1/completions", json={"model": server.model_id, "prompt": prompt, "max_tokens": 1,
                                           "temperature": 0, "prompt_logprobs": k})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["system_fingerprint"].startswith("kiln-")
    rows = body["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(prompt) and rows[0] is None
    with torch.no_grad():
        logp = direct_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for i in range(1, len(prompt)):
        row = rows[i]
        dist = logp[i - 1]
        actual = prompt[i]
        assert str(actual) in row
        expected_keys = {str(actual)} | {str(t) for t in dist.topk(k).indices.tolist()} if k else {str(actual)}
        assert set(row) == expected_keys
        assert len(row) in (k, k + 1) if k else len(row) == 1
        for key, entry in row.items():
            tid = int(key)
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["logprob"] == pytest.approx(dist[tid].item(), abs=1e-4)
            assert entry["rank"] == int((dist >= dist[tid]).sum())
            assert isinstance(entry["decoded_token"], str)


def test_prompt_logprobs_with_max_tokens_zero(http, server):
    r = http.post("/v1/completions", json={"model": server.model_id, "prompt": [5, 6, 7], "max_tokens": 0,
                                           "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == ""
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 3
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


# -- errors -------------------------------------------------------------------------


def chat_body(server, **kw):
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(kw)
    return body


@pytest.mark.parametrize("override,field", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 9}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"seed": -5}, "seed"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"stop": [""]}, "stop"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"stream": "yes please"}, "stream"),
])
def test_chat_validation_errors_are_400(http, server, override, field):
    err = assert_error(http.post("/v1/chat/completions", json=chat_body(server, **override)), 400, "invalid_request")
    assert field in err["message"]


def test_missing_model_field_is_400(http):
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)


def test_unknown_model_is_404(http, server):
    err = assert_error(http.post("/v1/chat/completions", json=chat_body(server, model="no-such-model")), 404,
                       "model_not_found")
    assert server.model_id in err["hint"]
    assert_error(http.post("/v1/completions", json={"model": "x", "prompt": "hi"}), 404, "model_not_found")


def test_invalid_json_is_400(http):
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")


def test_body_over_limit_is_413(http, server):
    big = "x" * (5 * 1024 * 1024)  # default server.max_body_bytes is 4 MiB
    r = http.post("/v1/chat/completions", json=chat_body(server, messages=[{"role": "user", "content": big}]))
    assert_error(r, 413, "payload_too_large")


def test_chunked_body_over_limit_is_413(http, server):
    def gen():
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"y" * 65536
        yield b'"}]}'

    r = http.post("/v1/chat/completions", content=gen(), headers={"content-type": "application/json"})
    assert_error(r, 413, "payload_too_large")


def test_adapter_upload_has_its_own_body_limit(http, server):
    # 5 MiB is over server.max_body_bytes (4 MiB) but under adapters.max_upload_bytes, so
    # the body reaches the upload route, which refuses it as an archive, not as too large.
    r = http.post("/v1/adapters/big/upload", content=b"\0" * (5 * 1024 * 1024),
                  headers={"content-type": "application/gzip"})
    assert 400 <= r.status_code < 500 and r.status_code != 413, r.text
    assert r.json()["error"]["code"] != "payload_too_large"


def test_configured_limits_are_400(http, server):
    # limits.max_n is 6 for this server (env layer)
    assert_error(http.post("/v1/chat/completions", json=chat_body(server, n=7)), 400, "limit_exceeded")
    assert_error(http.post("/v1/chat/completions", json=chat_body(server, max_tokens=3000)), 400, "limit_exceeded")
    assert_error(http.post("/v1/chat/completions", json=chat_body(server, logprobs=True, top_logprobs=50)), 400,
                 "limit_exceeded")
    assert_error(http.post("/v1/chat/completions", json=chat_body(server, stop=[f"s{i}" for i in range(9)])), 400,
                 "limit_exceeded")
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": [1, 2],
                                                    "prompt_logprobs": 21}), 400, "limit_exceeded")


def test_context_length_is_400(http, server):
    # limits.max_model_len is 512 for this server (CLI layer)
    r = http.post("/v1/completions", json={"model": server.model_id, "prompt": [5] * 600, "max_tokens": 1})
    assert_error(r, 400, "context_length_exceeded")
    r = http.post("/v1/completions", json={"model": server.model_id, "prompt": [5] * 500, "max_tokens": 50})
    assert_error(r, 400, "context_length_exceeded")


def test_completion_prompt_errors(http, server):
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": [1, 10**6]}), 400,
                 "invalid_token_id")
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": [-1]}), 400)
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": []}), 400)
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": ""}), 400)
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": "a", "suffix": "b"}), 400)
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": "a", "max_tokens": -1}), 400)
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": [1, 2], "stream": True,
                                                    "prompt_logprobs": 1}), 400)


def test_top_logprobs_without_logprobs_is_400(http, server):
    assert_error(http.post("/v1/chat/completions", json=chat_body(server, top_logprobs=2)), 400)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404, "not_found")
    assert_error(http.get("/v1/chat/completions"), 405, "method_not_allowed")


def test_wrong_content_type_is_4xx(http, server):
    r = http.post("/v1/chat/completions", content=b"model=x", headers={"content-type": "text/plain"})
    assert 400 <= r.status_code < 500
    assert set(r.json()["error"]) == {"message", "type", "param", "code", "hint"}


# -- ops endpoints ---------------------------------------------------------------------


def test_health(http, server):
    h = http.get("/health").json()
    assert h["status"] == "ok"
    assert h["model"] == server.model_id
    assert len(h["base_model_sha256"]) == 64
    assert h["backend"] == "hf" and h["device"] == default_device()
    assert h["uptime_s"] > 0
    assert h["queued_rows"] == 0 and h["active_rows"] == 0  # idle: no request of this test is in flight
    assert h["memory"]["rss_bytes"] > 0 and h["memory"]["kv_cache_bytes"] > 0
    assert h["memory"]["kv_workspace_bytes"] >= 0
    models = http.get("/v1/models").json()["data"]
    assert models[0]["base_model_sha256"] == h["base_model_sha256"]


def test_every_admission_ends_whatever_the_request_becomes(http, server):
    """A generation request counts as admitting from its handler's start to its submission; a
    refused, failed, streamed or blocking request leaves none open (an open one would make every
    burst wait batching's burst_max_s)."""
    assert_error(http.post("/v1/chat/completions", json=chat_body(server, model="no-such-model")), 404)
    assert_error(http.post("/v1/completions", json={"model": server.model_id, "prompt": "hi", "max_tokens": 10**6}),
                 400)
    assert_error(http.post("/v1/chat/completions", json=chat_body(server, max_tokens=10**6)), 400)
    assert http.post("/v1/chat/completions", json=chat_body(server)).status_code == 200
    with http.stream("POST", "/v1/chat/completions", json=chat_body(server, stream=True)) as r:
        assert r.status_code == 200 and b"[DONE]" in b"".join(r.iter_bytes())
    scored = http.post("/v1/completions", json={"model": server.model_id, "prompt": "hi there", "max_tokens": 1,
                                                 "prompt_logprobs": 1})
    assert scored.status_code == 200
    h = http.get("/health").json()
    assert h["admitting"] == 0
    assert h["engine_prefill"]["wide_steps"] >= 0 and "threads" in h["engine_prefill"]


def test_metrics_exposition(http, server):
    http.post("/v1/chat/completions", json=chat_body(server))
    http.post("/v1/chat/completions", json=chat_body(server, model="nope"))
    text = http.get("/metrics").text
    for name in ("kiln_requests_total", "kiln_generated_tokens_total", "kiln_active_rows", "kiln_queued_rows",
                 "kiln_time_to_first_token_seconds_bucket", "kiln_inter_token_latency_seconds_bucket",
                 "kiln_request_duration_seconds_bucket"):
        assert name in text, name
    assert 'kiln_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert 'kiln_requests_total{endpoint="/v1/chat/completions",status="404"}' in text


def test_config_precedence(http):
    body = http.get("/v1/config").json()
    s = body["settings"]
    assert body["config_file"].endswith("kiln.toml")
    # toml < env < cli
    assert s["batching.token_budget"] == {"value": 384, "source": "cli"}  # toml 300, env 320, cli 384
    assert s["limits.max_n"] == {"value": 6, "source": "env"}  # toml 5, env 6
    assert s["batching.max_queued_rows"] == {"value": 200, "source": "file"}
    assert s["server.request_timeout_s"] == {"value": 120.0, "source": "file"}
    assert s["limits.max_model_len"] == {"value": 512, "source": "cli"}
    assert s["batching.max_running_rows"] == {"value": 32, "source": "default"}
    assert all(set(v) == {"value", "source"} for v in s.values())
    assert body["effective"]["compile_decode"] == {"requested": False, "effective": False, "error": None}
