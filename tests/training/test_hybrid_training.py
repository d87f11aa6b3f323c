"""Training on a Qwen3.5 hybrid (Gated DeltaNet + full attention) through a real ``kiln serve``: an
SFT correction is learned with LoRA on the linear-attention and attention projections and served
after the hot-swap (streaming the engine's per-row state through the adapter); GRPO and OPD jobs
run on it. The tiny hybrid is built at test time (random weights, the built-in tokenizer)."""

from __future__ import annotations

import httpx
import pytest

from kiln.demo import CORRECTION, QUESTION, correction_body, wait_job
from tests.hybrid_models import build_tiny_hybrid
from tests.serving.conftest import start_server, stop_server

MSGS = [{"role": "user", "content": QUESTION}]
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def client(builtin_model_dir, tmp_path_factory):
    model_dir = build_tiny_hybrid(tmp_path_factory.mktemp("hybrid"), builtin_model_dir)
    srv = start_server(model_dir, tmp_path_factory.mktemp("hybrid-train-home"), extra_args=[], env_extra={},
                       config=None)
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        c.model_id = srv.model_id
        yield c
    assert stop_server(srv) == 0


def ask(c: httpx.Client, model: str) -> str:
    r = c.post("/v1/chat/completions", json={"model": model, "messages": MSGS, "temperature": 0, "max_tokens": 24})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def find_key(tree, key: str):
    """The value under ``key`` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    for item in tree if isinstance(tree, list) else []:
        found = find_key(item, key)
        if found is not None:
            return found
    return None


def idle_state(c: httpx.Client) -> dict:
    h = c.get("/health").json()
    return {"active_rows": h["active_rows"], "slots_used": h["linear_state"]["slots_used"]}


@pytest.fixture(scope="module")
def corrected(client):
    assert ask(client, client.model_id) != CORRECTION
    # The hybrid here has random weights: with the SFT defaults (lr 1e-3 and the KL-to-base anchor, tuned for
    # models that know something) the correction is not learned within the step cap, and the locality guard
    # holds back whatever changes a random model's answers. This file tests the hybrid's training path (every
    # projection targeted, hot swap, the served answer), so it asks for the previous lr and overrides the guard.
    body = correction_body("fix", QUESTION, CORRECTION) | {"learning_rate": 1e-2, "locality": {"override": True}}
    r = client.post("/v1/train/sft", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"], timeout=JOB_TIMEOUT_S)
    assert job["state"] == "succeeded", job.get("error")
    return job


def test_sft_correction_on_linear_and_attention_projections_is_served_after_hot_swap(client, corrected):
    report = corrected["result"]["report"]
    assert corrected["result"]["activated"] and report["learned"] is True, report
    manifest = client.get("/v1/adapters/fix").json()["manifest"]
    targets = set(find_key(manifest, "lora_target_modules"))
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj", "v_proj",
            "o_proj"} == targets, manifest
    assert ask(client, "fix") == CORRECTION
    assert ask(client, client.model_id) != CORRECTION  # the base model is untouched
    assert idle_state(client) == {"active_rows": 0, "slots_used": 0}


def test_grpo_job_runs_on_the_hybrid(client, corrected):
    body = {"adapter": "g", "epochs": 2, "groups": [
        {"messages": [{"role": "user", "content": "Pick"}],
         "completions": [{"text": "blue", "reward": 1}, {"text": "red", "reward": 0}]}]}
    r = client.post("/v1/train/grpo", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"], timeout=JOB_TIMEOUT_S)
    assert job["state"] == "succeeded", job.get("error")
    assert job["result"]["report"]["steps"] == 2


def test_opd_job_runs_on_the_hybrid(client, corrected):
    r = client.post("/v1/teachers", json={"alias": "tutor", "kind": "local", "adapter": "fix"})
    assert r.status_code == 201, r.text
    body = {"adapter": "student", "teacher": "tutor", "prompts": [{"messages": MSGS}], "samples_per_prompt": 2,
            "max_tokens": 8, "top_k": 4, "steps": 3, "batch_size": 1, "auto_load": True}
    r = client.post("/v1/train/opd", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"], timeout=JOB_TIMEOUT_S)
    assert job["state"] == "succeeded", job.get("error")
    assert job["result"]["report"]["steps"] == 3 and job["kind"] == "opd"
    assert idle_state(client) == {"active_rows": 0, "slots_used": 0}
