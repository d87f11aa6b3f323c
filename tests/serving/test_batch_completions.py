"""``POST /v1/completions/batch`` on the shared server: results per prompt as /v1/completions gives them, the
documented limits, and cancellation of every row when the client leaves."""

from __future__ import annotations

import json
import socket
import time

from kiln.config import LimitsSettings

PROMPTS = ["The capital of France is", [5, 6, 7, 8], "Once upon a time"]


def test_results_match_single_completions(http, server):
    body = {"model": server.model_id, "prompts": PROMPTS, "max_tokens": 8, "temperature": 0, "n": 2,
            "logprobs": 1}
    r = http.post("/v1/completions/batch", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion.batch" and r.headers["x-kiln-adapter-revision"] == "base"
    assert [res["index"] for res in out["results"]] == [0, 1, 2]
    total = 0
    for p, res in zip(PROMPTS, out["results"]):
        single = http.post("/v1/completions", json={"model": server.model_id, "prompt": p, "max_tokens": 8,
                                                    "temperature": 0, "n": 2, "logprobs": 1}).json()
        assert [c["index"] for c in res["choices"]] == [0, 1]
        assert [c["text"] for c in res["choices"]] == [c["text"] for c in single["choices"]]
        assert [c["logprobs"]["tokens"] for c in res["choices"]] == [c["logprobs"]["tokens"]
                                                                    for c in single["choices"]]
        total += single["usage"]["completion_tokens"]
    assert out["usage"]["completion_tokens"] == total


def test_limits_and_refusals(http, server):
    base = {"model": server.model_id, "max_tokens": 2}
    too_many = http.post("/v1/completions/batch", json={**base, "prompts": ["x"] * 65})  # limits.max_batch_prompts
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompts"
    assert "max_batch_prompts=64" in too_many.json()["error"]["message"]
    assert http.post("/v1/completions/batch", json={**base, "prompts": ["x"] * 257}).status_code == 400
    assert http.post("/v1/completions/batch", json={**base, "prompts": []}).status_code == 400
    streamed = http.post("/v1/completions/batch", json={**base, "prompts": ["x"], "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert http.post("/v1/completions/batch", json={**base, "prompts": [[10 ** 8]]}).status_code == 400
    unknown = http.post("/v1/completions/batch", json={**base, "prompts": ["x"], "model": "nope"})
    assert unknown.status_code == 404


def test_documented_in_openapi(openapi_checker):
    spec = openapi_checker.doc
    op = spec["paths"]["/v1/completions/batch"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    prompts = spec["components"]["schemas"][ref]["properties"]["prompts"]
    # the served document states this server's limits.max_batch_prompts (the default, 64), not only the ceiling (256)
    assert prompts["maxItems"] == LimitsSettings().max_batch_prompts and prompts["minItems"] == 1
    assert "max_batch_prompts" in prompts["description"]


def _metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_disconnect_cancels_every_row(http, server):
    n, max_tokens = 5, 450
    body = json.dumps({"model": server.model_id, "prompts": PROMPTS, "n": n, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    before = _metric(http, "kiln_generated_tokens_total")
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions/batch HTTP/1.1\r\nHost: " + f"{host}:{port}".encode()
                 + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while (active := http.get("/health").json()["active_rows"]) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert active >= 1, "the batch never started (was the request refused?)"
    sock.close()  # the client leaves before the answer
    deadline = time.monotonic() + 20
    health = http.get("/health").json()
    while (health["active_rows"] or health["queued_rows"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        health = http.get("/health").json()
    assert health["active_rows"] == 0 and health["queued_rows"] == 0
    done = _metric(http, "kiln_generated_tokens_total") - before
    assert done < n * len(PROMPTS) * max_tokens, "the rows ran to the end instead of being cancelled"


def test_a_request_larger_than_the_queue_is_a_400_naming_the_limit(http, server):
    """Issue 45 item 6: 64 prompts x n (or 34 x n on /v1/completions) ask for more rows than the queue holds
    (``batching.max_queued_rows`` = 200 on this server); that got 429 Retry-After forever on an idle server."""
    base = {"model": server.model_id, "max_tokens": 1, "n": 6}
    for path, field, count in (("/v1/completions/batch", "prompts", 64), ("/v1/completions", "prompt", 34)):
        r = http.post(path, json={**base, field: ["x"] * count})
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "limit_exceeded" and err["param"] == "n", err
        assert f"{count * 6} rows" in err["message"] and "batching.max_queued_rows" in err["message"], err
        assert "retry-after" not in r.headers
    fits = http.post("/v1/completions", json={**base, "prompt": ["x"] * 33})  # 198 rows: admitted
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 198, fits.text


def test_a_too_long_prompt_in_a_batch_is_named_and_stops_the_rest(http, server):
    """Issue 45 item 7: the first prompt over the context (512 tokens here) is refused naming ``prompt[j]``,
    before the prompts after it are looked at (prompt[3] holds a token outside the vocabulary: never reached)."""
    base = {"model": server.model_id, "max_tokens": 4}
    prompts = ["fine", [5, 6, 7], [7] * 600, [10 ** 9], [7] * 700]
    r = http.post("/v1/completions/batch", json={**base, "prompts": prompts})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt[2]", err
    assert "prompt[2]" in err["message"]
    near = http.post("/v1/completions", json={**base, "prompt": [[5, 6], [7] * 510], "max_tokens": 8})
    err = near.json()["error"]  # fits alone, not with max_tokens: still that prompt's fault, named
    assert near.status_code == 400 and err["param"] == "prompt[1]" and "max_tokens (8)" in err["message"], err
