"""Issue item 2: what the server sends matches the schemas it publishes.

Each scenario goes through the ``client`` fixture, whose response hook validates
status, media type and body (JSON, or every SSE event against the operation's
``x-kiln-event-schema``) against ``/openapi.json``. The stream scenarios are
also validated with the pydantic models themselves.
"""

from __future__ import annotations

import io
import json
import tarfile
import time

import pytest

from kiln.serving import openai_responses as oai
from kiln.serving import protocol as p
from tests.security.openapi_check import sse_events


def _chat(server, **kw):
    return {"model": server.model_id, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4,
            **kw}


def _completion(server, **kw):
    return {"model": server.model_id, "prompt": "Hello there", "max_tokens": 4, **kw}


_TOOL = {"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {"z": {"enum": ["a", "b"]}}, "required": ["z"], "additionalProperties": False}}}
CHAT_VARIANTS = [{}, {"n": 2, "temperature": 0.7, "seed": 3}, {"logprobs": True, "top_logprobs": 2},
                 {"stop": ["e"]}, {"max_completion_tokens": 1},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "strict": True, "schema": {
                     "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
                 {"tools": [_TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 30},
                 # a tool-call history without "tools" (the built-in template's tools section would take
                 # the prompt past this server's 256-token limit)
                 {"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
                               {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}]
COMPLETION_VARIANTS = [{}, {"n": 2, "seed": 1, "temperature": 1.0}, {"logprobs": 2}, {"prompt_logprobs": 2},
                       {"max_tokens": 0, "prompt_logprobs": 1}, {"prompt": [5, 6, 7]},
                       {"prompt": ["a", "b"], "n": 2}, {"prompt": [[5, 6], [7]]}, {"echo": True, "logprobs": 1},
                       {"frequency_penalty": 1.0, "logit_bias": {"5": -5}, "min_p": 0.1, "repetition_penalty": 1.2},
                       {"guided_choice": ["yes", "no"]}]


@pytest.mark.parametrize("variant", CHAT_VARIANTS)
def test_chat_json(client, secure_server, variant):
    r = client.post("/v1/chat/completions", json=_chat(secure_server, **variant))
    assert r.status_code == 200, r.text
    oai.ChatCompletionResponse.model_validate(r.json())


@pytest.mark.parametrize("variant", COMPLETION_VARIANTS)
def test_completion_json(client, secure_server, variant):
    r = client.post("/v1/completions", json=_completion(secure_server, **variant))
    assert r.status_code == 200
    oai.CompletionResponse.model_validate(r.json())


def test_batch_completion_json(client, secure_server):
    r = client.post("/v1/completions/batch", json={"model": secure_server.model_id, "prompts": ["a", [5, 6]],
                                                    "n": 2, "max_tokens": 3, "logprobs": 1})
    assert r.status_code == 200, r.text
    oai.BatchCompletionResponse.model_validate(r.json())


STREAM_VARIANTS = [{}, {"stream_options": {"include_usage": True}}, {"n": 2, "seed": 4, "temperature": 1.0},
                   {"logprobs_variant": True}, {"tools_variant": True}]


@pytest.mark.parametrize("variant", STREAM_VARIANTS)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streams(client, secure_server, route, variant):
    variant = dict(variant)
    if variant.pop("logprobs_variant", False):
        variant = {"logprobs": True, "top_logprobs": 1} if route == "chat" else {"logprobs": 1}
    if variant.pop("tools_variant", False):  # delta.tool_calls events (completions: a guided choice)
        variant = ({"tools": [_TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 30}
                   if route == "chat" else {"guided_choice": ["x", "y"]})
    if route == "chat":
        path, body, model = "/v1/chat/completions", _chat(secure_server, stream=True, **variant), oai.ChatCompletionChunk
    else:
        path, body, model = "/v1/completions", _completion(secure_server, stream=True, **variant), oai.CompletionChunk
    r = client.post(path, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        model.model_validate(json.loads(event))


ERROR_CASES = [
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 999}, 400),
    ("/v1/completions", {"model": "m", "prompt": "x", "suffix": "y"}, 400),
    ("/v1/completions", {"model": "m", "prompt": "x", "bogus": 1}, 400),
    ("/v1/completions/batch", {"model": "m", "prompts": []}, 400),
    ("/v1/train/sft", {"adapter": "bad name!"}, 400),
    ("/v1/train/grpo", {"adapter": "g", "groups": []}, 400),
    ("/v1/train/kd", {"adapter": "k"}, 400),
    ("/v1/adapters/merge", {"name": "m", "adapters": [{"name": "missing"}]}, 404),
]


@pytest.mark.parametrize(("path", "body", "status"), ERROR_CASES)
def test_errors(client, path, body, status):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    oai.ErrorResponse.model_validate(r.json())


def test_error_bodies_of_other_routes(client):
    for r in (client.get("/v1/train/jobs/job-0000000000000000"), client.get("/v1/train/jobs/nope"),
              client.delete("/v1/train/queue/job-0000000000000000"), client.get("/v1/adapters/missing"),
              client.post("/v1/adapters/missing/load"), client.post("/v1/adapters/missing/unload"),
              client.delete("/v1/adapters/missing"), client.get("/v1/adapters/missing/download"),
              client.post("/v1/adapters/x/upload", content=b"not gzip", headers={"content-type": "application/gzip"}),
              client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}),
              client.get("/v1/nothing"), client.get("/v1/chat/completions")):
        assert r.status_code >= 400
        oai.ErrorResponse.model_validate(r.json())


def test_ops_and_models(client):
    p.HealthResponse.model_validate(client.get("/health").json())
    p.ConfigResponse.model_validate(client.get("/v1/config").json())
    oai.ModelList.model_validate(client.get("/v1/models").json())
    assert client.get("/metrics").status_code == 200


def _wait(client, job_id: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = client.get(f"/v1/train/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not finish")


def test_training_and_adapter_lifecycle(client, secure_server):
    example = {"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Kiln."}]}
    job = client.post("/v1/train/sft", json={"adapter": "schema-a", "examples": [example], "max_steps": 2,
                                             "epochs": 1, "auto_load": True})
    assert job.status_code == 202
    p.TrainingJob.model_validate(job.json())
    assert _wait(client, job.json()["id"])["state"] == "succeeded"
    grpo = client.post("/v1/train/grpo", json={"adapter": "schema-g", "max_steps": 1, "epochs": 1, "groups": [
        {"messages": [{"role": "user", "content": "Say yes"}],
         "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}]}]})
    assert grpo.status_code == 202
    # a queued job can be cancelled (or it finished already: 409 either way validates)
    queued = client.post("/v1/train/sft", json={"adapter": "schema-c", "examples": [example], "max_steps": 50})
    cancel = client.delete(f"/v1/train/queue/{queued.json()['id']}")
    assert cancel.status_code in (200, 409)
    _wait(client, grpo.json()["id"])
    _wait(client, queued.json()["id"])
    p.TrainingStatus.model_validate(client.get("/v1/train/status").json())

    listed = client.get("/v1/adapters").json()
    p.AdapterList.model_validate(listed)
    assert "schema-a" in {a["name"] for a in listed["data"]}
    p.AdapterDetail.model_validate(client.get("/v1/adapters/schema-a").json())
    receipt = client.get("/v1/adapters/schema-a/receipt").json()
    assert p.TrainingReceipt.model_validate(receipt).schema_ == "kiln.training-receipt.v1"
    chat = client.post("/v1/chat/completions", json=_chat(secure_server, model="schema-a"))
    assert chat.status_code == 200
    models = client.get("/v1/models").json()
    assert any(m["id"] == "schema-a" for m in models["data"])
    p.AdapterUnloaded.model_validate(client.post("/v1/adapters/schema-a/unload").json())
    p.AdapterLoaded.model_validate(client.post("/v1/adapters/schema-a/load").json())
    archive = client.get("/v1/adapters/schema-a/download")
    assert archive.status_code == 200 and tarfile.open(fileobj=io.BytesIO(archive.content))
    up = client.post("/v1/adapters/schema-b/upload", content=archive.content,
                     headers={"content-type": "application/gzip"})
    assert up.status_code == 201, up.text
    p.AdapterInfo.model_validate(up.json())
    merged = client.post("/v1/adapters/merge", json={"name": "schema-m", "adapters": [
        {"name": "schema-a"}, {"name": "schema-b"}]})
    assert merged.status_code == 201, merged.text
    p.AdapterMerged.model_validate(merged.json())
    assert client.get("/v1/adapters/schema-m/receipt").json()["error"]["code"] == "receipt_not_found"
    oai.ErrorResponse.model_validate(client.delete("/v1/adapters/schema-a").json())  # 409: being served
    client.post("/v1/adapters/schema-a/unload")
    for name in ("schema-a", "schema-b", "schema-m"):
        p.AdapterDeleted.model_validate(client.delete(f"/v1/adapters/{name}").json())


def test_teachers_and_opd(client):
    """The teacher registry (a local teacher: this server's own model) and one short OPD job."""
    r = client.post("/v1/teachers", json={"alias": "schema-t", "kind": "local"})
    assert r.status_code == 201, r.text
    listed = client.get("/v1/teachers")
    assert listed.status_code == 200 and "schema-t" in {t["alias"] for t in listed.json()["data"]}
    assert client.get("/v1/teachers/schema-t").status_code == 200
    assert client.post("/v1/teachers", json={"alias": "schema-t", "kind": "local"}).status_code == 409
    assert client.get("/v1/teachers/absent").status_code == 404
    manifest = client.get("/v1/teacher/manifest")  # this server's own teacher manifest (the base model)
    assert manifest.status_code == 200 and set(manifest.json()) >= {"identity", "system_fingerprint"}, manifest.text
    assert client.get("/v1/teacher/manifest", params={"model": "absent"}).status_code == 404
    job = client.post("/v1/train/opd", json={
        "adapter": "schema-o", "teacher": "schema-t", "prompts": [{"messages": [{"role": "user", "content": "Hi"}]}],
        "samples_per_prompt": 2, "max_tokens": 4, "top_k": 4, "steps": 1, "batch_size": 1})
    assert job.status_code == 202, job.text
    p.TrainingJob.model_validate(job.json())
    assert _wait(client, job.json()["id"])["state"] == "succeeded"
    assert client.delete("/v1/teachers/schema-t").status_code == 200
    assert client.get("/v1/teachers/schema-t").status_code == 404


def test_tokenize_and_detokenize(client, secure_server):
    r = client.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    assert r.status_code == 200
    oai.TokenizeResponse.model_validate(r.json())
    chat = client.post("/tokenize", json={"model": secure_server.model_id,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200
    d = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert d.status_code == 200 and d.json()["prompt"] == "Hello there"
    oai.ErrorResponse.model_validate(client.post("/detokenize", json={"tokens": [10**8]}).json())


def test_openenv_runs(client):
    """An OpenEnv run: a preflight refusal, then a run against a loopback port nobody serves (fails at discovery)."""
    from tests.serving.conftest import free_port

    body = {"env_url": f"http://127.0.0.1:{free_port()}", "group_size": 2, "groups": 1,
            "training": {"adapter": "schema-oe", "learning_rat": 0.1}}
    bad = client.post("/v1/openenv/runs", json=body)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_training_config"
    body["training"] = {"adapter": "schema-oe"}
    r = client.post("/v1/openenv/runs", json=body)
    assert r.status_code == 202, r.text
    run_id = r.json()["id"]
    deadline = time.monotonic() + 60
    while (run := client.get(f"/v1/openenv/runs/{run_id}").json())["state"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, run
        time.sleep(0.1)
    assert run["state"] == "failed" and run["error"]["code"] == "environment_unavailable"
    assert run_id in {x["id"] for x in client.get("/v1/openenv/runs").json()["data"]}
    assert client.post(f"/v1/openenv/runs/{run_id}/cancel").status_code == 409
    assert client.get("/v1/openenv/runs/oerun-0000000000000000").status_code == 404
    # preflight: a typo (400) and an environment nobody serves (503); a failed run has no artifacts (404)
    body["training"] = {"adapter": "schema-oe", "learning_rat": 0.1}
    assert client.post("/v1/openenv/preflight", json=body).status_code == 400
    body["training"] = {"adapter": "schema-oe"}
    assert client.post("/v1/openenv/preflight", json=body).json()["error"]["code"] == "environment_unavailable"
    assert client.get(f"/v1/openenv/runs/{run_id}/artifacts/replay.json").status_code == 404


def test_eval_and_default_adapter_routes_answer_as_documented(client, secure_server):
    """Every /v1/evals route, the default adapter and the quarantine route, through the checked client
    (a status or body the OpenAPI document does not have fails the hook)."""
    jsonl = '{"id": "a", "messages": [{"role": "user", "content": "2+2?"}], "reference": "4"}\n'
    suite = {"name": "schema-suite", "jsonl": jsonl, "scorers": [{"type": "exact"}],
             "generation": {"max_tokens": 2}}
    r = client.post("/v1/evals/suites/import", json=suite)
    assert r.status_code == 201, r.text
    assert client.post("/v1/evals/suites/import", json=suite).status_code == 409  # exists
    assert client.post("/v1/evals/suites", json={"name": "x"}).status_code == 400
    assert "schema-suite" in str(client.get("/v1/evals/suites").json())
    assert client.get("/v1/evals/suites/schema-suite").status_code == 200
    run = client.post("/v1/evals/runs", json={"suite": "schema-suite"})
    assert run.status_code == 202, run.text
    run_id = run.json()["id"]
    deadline = time.monotonic() + 60
    while client.get(f"/v1/evals/runs/{run_id}").json()["state"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert run_id in str(client.get("/v1/evals/runs").json())
    assert client.post("/v1/evals/comparisons", json={"suite": "schema-suite", "targets": [{}]}).status_code == 400
    assert client.post("/v1/evals/replays", json={"run_id": "eval-0000000000000000"}).status_code == 404
    assert client.post("/v1/evals/gate", json={}).status_code == 400
    assert client.delete(f"/v1/evals/runs/{run_id}").status_code in (200, 409)
    assert client.delete("/v1/evals/suites/schema-suite").status_code == 200
    assert client.get("/v1/adapters/default").json() == {"default": None}
    assert client.put("/v1/adapters/default", json={"name": "no-such-adapter"}).status_code == 404
    assert client.delete("/v1/adapters/default").json() == {"default": None}
    assert client.post("/v1/adapters/no-such-adapter/quarantine/clear").status_code in (200, 404)


def test_judgment_routes_answer_as_documented(client):
    """Every /v1/judgments route through the checked client (record, page, export, one, train, compare)."""
    body = {"prompt": "2+2?", "response_a": "4", "response_b": "I cannot help.", "preferred": "a"}
    r = client.post("/v1/judgments", json=body)
    assert r.status_code == 201, r.text
    assert client.post("/v1/judgments", json={**body, "preferred": "c"}).status_code == 400
    assert client.get("/v1/judgments", params={"order": "desc", "limit": 1}).json()["data"][0]["id"] == r.json()["id"]
    assert client.get("/v1/judgments", params={"after": "jdg-0000000000000000"}).status_code == 404
    assert r.json()["id"] in client.get("/v1/judgments/export").text
    assert client.get(f"/v1/judgments/{r.json()['id']}").json() == r.json()
    assert client.get("/v1/judgments/jdg-0000000000000000").status_code == 404
    # one judgment stored: 409 too_few_judgments (503 where training is off)
    assert client.post("/v1/judgments/train", json={"adapter": "schema-judge"}).status_code in (409, 503)
    cmp = client.post("/v1/judgments/compare", json={k: v for k, v in body.items() if k != "preferred"})
    assert cmp.status_code == 200 and 0 < cmp.json()["p_a"] < 1, cmp.text


def test_debug_routes_answer_as_documented_while_off(client):
    """The diagnostic routes are 404 with their own codes while server.debug_* are off (the default)."""
    assert client.get("/v1/debug/requests").json()["error"]["code"] == "debug_requests_disabled"
    assert client.get("/v1/debug/model-state").json()["error"]["code"] == "debug_model_state_disabled"


def test_every_operation_was_exercised(checker):
    """Runs last in this module: the scenarios above reached every operation of kiln.serving.openapi.ROUTE_DOCS."""
    from kiln.serving.openapi import ROUTE_DOCS

    reached = {(m, t) for m, t, _ in checker.seen}
    documented = {(m.upper(), t) for m, t in ROUTE_DOCS}
    assert documented <= reached, sorted(documented - reached)
