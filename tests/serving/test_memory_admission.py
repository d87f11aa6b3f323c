"""Memory admission for training jobs and adapter loads, over a real ``kiln serve`` with a small
``limits.memory_budget_bytes``: 507 for work that can never fit, 409 for work that cannot fit beside
the reservations held now, reservations shown in GET /health and released when the work ends; the
server keeps serving chat throughout."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from kiln.adapters.footprint import adapter_bytes
from tests.adapters.conftest import base_info, make_lora, upload_adapter  # noqa: F401  (fixtures)
from tests.serving.conftest import OPS_MEMORY_BUDGET

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
POLL_S = 120


def _examples(n: int, words: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": " ".join(f"q{i}w{j}" for j in range(words))},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(n)]


def _sft(examples: list[dict], **extra) -> dict:
    return {"adapter": "mem-job", "examples": examples, "epochs": None, "until_learned": False, **extra}


def _chat_works(base: str, model: str) -> None:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text


def _budget(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=30).json()["memory_budget"]


def _needed(body: dict) -> int:
    return int(re.search(r"needs an estimated (\d+) bytes", body["error"]["message"]).group(1))


def _until(check, what: str):
    deadline = time.monotonic() + POLL_S
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_training_and_adapter_loads_are_admitted_by_memory(ops_server, make_lora, tmp_path):  # noqa: F811
    base, model = ops_server.base_url, ops_server.model_id
    budget = _budget(base)
    resident = sum(budget["resident"].values())
    room = OPS_MEMORY_BUDGET - resident
    assert budget["budget_bytes"] == OPS_MEMORY_BUDGET == budget["cap_bytes"]
    assert budget["resident"]["weights"] > 0 and budget["resident"]["kv_cache"] > 0
    assert budget["reservations"] == [] and budget["available_bytes"] == room > 0

    # 507: a job bigger than the whole room, whatever is released; named numbers; nothing queued
    r = httpx.post(f"{base}/v1/train/sft", json=_sft(_examples(16, 40), batch_size=16), timeout=60)
    assert r.status_code == 507 and r.json()["error"]["code"] == "memory_budget_exceeded", r.text
    assert _needed(r.json()) > room and str(OPS_MEMORY_BUDGET) in r.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/train/status").json()["queued"] == []
    _chat_works(base, model)

    # an adapter revision reserves its tensor bytes while it is served
    big = make_lora(r=256, targets=ALL_MODULES, seed=3)
    rev = upload_adapter(base, "mem-big", big, tmp_path)
    assert httpx.post(f"{base}/v1/adapters/mem-big/load", timeout=60).status_code == 200
    held = _budget(base)["reservations"]
    assert held == [{"kind": "adapter", "owner": f"mem-big@{rev}", "bytes": adapter_bytes(big),
                     "parts": {"adapter_weights": adapter_bytes(big)}}]
    available = room - adapter_bytes(big)

    # 409: a job that fits the room alone but not beside the adapter's reservation
    job = _sft(_examples(8, 2), batch_size=8, max_steps=400)
    r = httpx.post(f"{base}/v1/train/sft", json=job, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "memory_reserved", r.text
    need = _needed(r.json())
    assert available < need <= room, (available, need, room)
    assert f"mem-big@{rev}" in r.json()["error"]["message"]

    # 507 for an adapter that can never fit
    huge = make_lora(r=1024, targets=ALL_MODULES, seed=4)
    upload_adapter(base, "mem-huge", huge, tmp_path)
    r = httpx.post(f"{base}/v1/adapters/mem-huge/load", timeout=60)
    assert r.status_code == 507 and r.json()["error"]["code"] == "memory_budget_exceeded", r.text
    assert "mem-huge" not in httpx.get(f"{base}/health").json()["adapters"]
    _chat_works(base, model)

    # unloading releases the adapter's reservation; the same job is admitted and reserves while it runs
    assert httpx.post(f"{base}/v1/adapters/mem-big/unload", timeout=60).status_code == 200
    assert _budget(base)["reservations"] == []
    r = httpx.post(f"{base}/v1/train/sft", json=job, timeout=60)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    reservation = _until(lambda: [x for x in _budget(base)["reservations"] if x["owner"] == job_id],
                         "the running job's reservation")[0]
    assert reservation["kind"] == "training" and reservation["bytes"] == need
    assert set(reservation["parts"]) == {"lora", "activations", "lm_head_chunk", "teacher_topk"}
    _chat_works(base, model)  # serving goes on beside the job
    # while the job holds its reservation, loading the adapter again cannot fit now
    r = httpx.post(f"{base}/v1/adapters/mem-big/load", timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "memory_reserved", r.text
    assert job_id in r.json()["error"]["message"]

    # cancelling ends the job; its reservation goes with it
    assert httpx.delete(f"{base}/v1/train/queue/{job_id}", timeout=60).status_code == 200
    _until(lambda: httpx.get(f"{base}/v1/train/jobs/{job_id}").json()["state"] == "cancelled", "the cancel")
    _until(lambda: _budget(base)["reservations"] == [], "the released reservation")
    _chat_works(base, model)
    assert httpx.post(f"{base}/v1/adapters/mem-big/load", timeout=60).status_code == 200
    assert httpx.post(f"{base}/v1/adapters/mem-big/unload", timeout=60).status_code == 200


def test_eval_private_loads_are_admitted_by_memory(ops_server, make_lora, tmp_path):  # noqa: F811
    """An eval target's private load is admitted like any adapter load: 507 at submission when it can
    never fit (nothing queued), and a reservation of its tensor bytes while the run holds it."""
    from tests.evals.test_http import suite, wait_run

    base = ops_server.base_url
    with httpx.Client(base_url=base, timeout=60) as c:
        huge = make_lora(r=1024, targets=ALL_MODULES, seed=7)
        upload_adapter(base, "mem-eval-huge", huge, tmp_path)
        before = len(c.get("/v1/evals/runs").json()["data"])
        r = c.post("/v1/evals/runs", json={"inline_suite": suite("mem-huge", 2), "target": {"adapter": "mem-eval-huge"}})
        assert r.status_code == 507 and r.json()["error"]["code"] == "memory_budget_exceeded", r.text
        assert "mem-eval-huge" in r.json()["error"]["message"]
        assert len(c.get("/v1/evals/runs").json()["data"]) == before

        small = make_lora(seed=8)
        rev = upload_adapter(base, "mem-eval", small, tmp_path)
        long = suite("mem-eval", 64, generation={"max_tokens": 24})
        r = c.post("/v1/evals/runs", json={"inline_suite": long, "target": {"adapter": "mem-eval"}})
        assert r.status_code == 202, r.text
        held = _until(lambda: [x for x in _budget(base)["reservations"] if x["owner"].startswith("kiln-eval-")],
                      "the eval's private-load reservation")[0]
        assert held["kind"] == "adapter" and held["owner"].endswith(f"@{rev}")
        assert held["bytes"] == adapter_bytes(small) == held["parts"]["adapter_weights"]
        run = wait_run(c, r.json()["id"])
        assert run["state"] == "succeeded", run["error"]
        assert _budget(base)["reservations"] == []
