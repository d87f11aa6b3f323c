"""Sparse-KD jobs (``POST /v1/train/kd``) end to end through a real `kiln serve` on 127.0.0.1.

The served model is Kiln's built-in model (the student). The teacher is a tiny
random Qwen3 sharing its tokenizer files and vocabulary; it is captured
in-process (``kiln.distill.capture``) into ``<home>/data/runs/cap`` before the
server starts. Checked: refusals before queueing (confinement, a capture bound to
another student), the job consuming both shards through the ledger (one
reserve + one commit each, the commit naming the job's checkpoint), publication
with kind ``kd`` binding the capture plan, the hot-swap, the student's loss on
the captured targets going down, and a second identical job being refused.
"""

from __future__ import annotations

import json
import math
import shutil

import httpx
import pytest

from kiln.demo import wait_job
from tests.distill.tinymodels import (
    build_tiny_model,
    capture_in_process,
    make_plan,
    synthetic_examples,
)
from tests.serving.conftest import start_server, stop_server

pytest.importorskip("torch")

VOCAB = 551  # the built-in model's vocabulary
ADAPTER = "kd-student"


@pytest.fixture(scope="module")
def env(builtin_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kd-job")
    home = tmp / "home"
    runs = home / "data" / "runs"
    teacher = build_tiny_model(tmp / "teacher", vocab=VOCAB, seed=3, tokenizer_from=builtin_model_dir)
    examples = synthetic_examples(8, VOCAB, prompt=4, target=6, seed=5)
    plan_path, plan, data_root = make_plan(tmp / "p", teacher, builtin_model_dir, examples, top_k=8)
    capture_in_process(tmp / "p", teacher, plan_path, data_root, runs / "cap", examples_per_shard=4)
    # the same data captured under a plan whose student is the teacher: not the served model
    f_path, _f, f_data = make_plan(tmp / "f", teacher, teacher, examples[:2], top_k=8)
    capture_in_process(tmp / "f", teacher, f_path, f_data, runs / "foreign")
    # a student-rollout capture: consume-once, so replay is refused for it
    r_path, _r, r_data = make_plan(tmp / "r", teacher, builtin_model_dir, examples[:2], top_k=8,
                                   trajectory="student-rollout")
    capture_in_process(tmp / "r", teacher, r_path, r_data, runs / "rollout")
    srv = start_server(builtin_model_dir, home, extra_args=[], env_extra={}, config=None)
    c = httpx.Client(base_url=srv.base_url, timeout=120)
    yield {"c": c, "srv": srv, "home": home, "plan": plan, "examples": examples}
    c.close()
    stop_server(srv)


def _target_nll(c: httpx.Client, model: str, examples: list[dict]) -> float:
    """Mean negative log-likelihood of every captured target token given its prompt and earlier targets."""
    total, n = 0.0, 0
    for e in examples:
        p, t = e["prompt_token_ids"], e["target_token_ids"]
        r = c.post("/v1/completions", json={"model": model, "prompt": p + t, "max_tokens": 1, "prompt_logprobs": 1})
        assert r.status_code == 200, r.text
        rows = r.json()["choices"][0]["prompt_logprobs"]
        total -= sum(rows[len(p) + j][str(tok)]["logprob"] for j, tok in enumerate(t))
        n += len(t)
    return total / n


def test_kd_refusals_before_queueing(env):
    c = env["c"]
    base = {"adapter": ADAPTER, "run": "runs/cap"}
    r = c.post("/v1/train/kd", json=base | {"run": "../outside"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "dataset_outside_data_dir", r.text
    r = c.post("/v1/train/kd", json=base | {"run": "runs/nothing-here"})
    assert r.status_code == 404, r.text
    r = c.post("/v1/train/kd", json=base | {"run": "runs/foreign"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "capture_student_mismatch", r.text
    assert "student" in r.json()["error"]["message"]
    assert c.post("/v1/train/kd", json=base | {"max_steps": 3}).status_code == 400
    assert c.post("/v1/train/kd", json=base | {"ce_weight": 0, "kd_weight": 0}).status_code == 400
    assert c.get("/v1/train/status").json()["queued"] == []
    from typer.testing import CliRunner

    from kiln.training.cli import app

    res = CliRunner().invoke(app, ["kd", "--run", "runs/foreign", "--adapter", ADAPTER, "--url", env["srv"].base_url])
    assert res.exit_code != 0 and "capture_student_mismatch" in res.output, res.output


def test_kd_job_consumes_each_shard_once_and_publishes_a_kd_adapter(env):
    c, home, plan, examples = env["c"], env["home"], env["plan"], env["examples"]
    model_id = env["srv"].model_id
    before = _target_nll(c, model_id, examples)
    # the locality guard holds these settings' adapter back (docs/training.md, "Locality"); the job's mechanics are
    # under test here, so the operator overrides it (the guard itself: tests/training/test_locality.py)
    body = {"adapter": ADAPTER, "run": "runs/cap", "batch_size": 1, "learning_rate": 2e-2, "lora_rank": 8,
            "seed": 1, "auto_load": True, "locality": {"override": True}}
    r = c.post("/v1/train/kd", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], timeout=120)
    assert job["state"] == "succeeded", job.get("error")
    assert job["kind"] == "kd"
    res = job["result"]
    rep = res["report"]
    assert res["activated"] is True, res
    assert res["locality"]["probes"] > 0 and 0 <= res["locality"]["unchanged_fraction"] <= 1  # every kind measures
    assert rep["steps"] == 8 and rep["total_steps"] == 8 and math.isfinite(rep["final_loss"])
    assert [s["action"] for s in rep["shards"]] == ["trained", "trained"]

    # published with kind kd, binding the capture plan
    info = c.get(f"/v1/adapters/{ADAPTER}").json()
    assert info["kind"] == "kd" and info["active"] is True
    assert info["manifest"]["config"]["capture_plan_sha256"] == plan.digest()
    receipt = json.loads((home / "adapters" / ADAPTER / "revisions" / res["revision"] / "kiln-receipt.json")
                         .read_text())  # the receipt names the capture and its teacher (docs/adapters.md)
    assert receipt["inputs"]["capture_plan_sha256"] == plan.digest() and receipt["adapter"]["kind"] == "kd"
    assert receipt["teacher"]["fingerprint_sha256"] == plan.teacher.digest()

    # the ledger: one reservation and one commit per shard, the commit naming the job's checkpoint
    ledgers = sorted((home / "data" / "runs" / "cap" / ".consumption").glob("*.jsonl"))  # beside the capture
    assert len(ledgers) == 2
    commits = {c_["transaction_id"]: c_["checkpoint_sha256"] for c_ in rep["kd_commits"]}
    for path in ledgers:
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert [e["next_state"] for e in events] == ["reserved", "committed"]
        assert events[-1]["checkpoint_sha256"] == commits[path.stem]
        assert events[0]["run_id"] == job["id"]

    # the student's loss on the captured targets went down (the adapter is hot-swapped in)
    after = _target_nll(c, ADAPTER, examples)
    assert after < before - 0.1, (before, after, rep)

    # a second identical job without replay consumes nothing: refused before queueing, ledgers untouched
    snapshot = [p.read_bytes() for p in ledgers]
    r = c.post("/v1/train/kd", json=body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "capture_consumed", r.text
    assert [p.read_bytes() for p in ledgers] == snapshot


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kd_replay_trains_a_consumed_shard_again_only_when_asked(env):
    """After the job above committed both shards: replay=true makes one chained replay per shard, each
    reservation's replay_of being the hash of the shard's last commit event (spec: consumption ledger)."""
    from kiln.distill.contract import ConsumptionEvent

    c, home, plan = env["c"], env["home"], env["plan"]
    # the locality guard holds these settings' adapter back (docs/training.md, "Locality"); the job's mechanics are
    # under test here, so the operator overrides it (the guard itself: tests/training/test_locality.py)
    body = {"adapter": ADAPTER, "run": "runs/cap", "batch_size": 1, "learning_rate": 2e-2, "lora_rank": 8,
            "seed": 1, "auto_load": True, "locality": {"override": True}}
    ledgers = sorted((home / "data" / "runs" / "cap" / ".consumption").glob("*.jsonl"))  # beside the capture
    assert [[e["next_state"] for e in _events(p)] for p in ledgers] == [["reserved", "committed"]] * 2
    r = c.post("/v1/train/kd", json=body | {"replay": True})
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], timeout=120)
    assert job["state"] == "succeeded", job.get("error")
    rep = job["result"]["report"]
    assert [s["action"] for s in rep["shards"]] == ["replayed", "replayed"] and rep["steps"] == 8
    for path in ledgers:
        events = _events(path)
        assert [(e["prior_state"], e["next_state"]) for e in events] == [
            ("available", "reserved"), ("reserved", "committed"), ("committed", "reserved"), ("reserved", "committed")]
        assert events[0]["replay_of"] is None
        assert events[2]["replay_of"] == ConsumptionEvent.parse(events[1]).digest()
        assert events[2]["run_id"] == events[3]["run_id"] == job["id"]
    # without replay the capture stays consumed; a student-rollout capture refuses replay before queueing
    r = c.post("/v1/train/kd", json=body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "capture_consumed", r.text
    r = c.post("/v1/train/kd", json={"adapter": "kd-rollout", "run": "runs/rollout", "replay": True})
    assert r.status_code == 409 and r.json()["error"]["code"] == "replay_forbidden", r.text
    assert not (home / "data" / "runs" / "rollout" / ".consumption").exists()


@pytest.mark.parametrize("after_reserve_first", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kd_job_killed_after_its_checkpoint_reconciles_on_resume_without_retraining(env, tmp_path,
                                                                                    after_reserve_first):
    """`kiln serve` dies (os._exit, like kill -9) right after the durable checkpoint of the first shard and
    before its ledger commit. A fresh job is then refused (the checkpoint holds that training) and resuming
    the job appends exactly one commit naming that checkpoint, then trains only the second shard. The slow
    variant first dies right after a reservation: the next job releases it (no checkpoint holds it)."""
    from kiln.distill.faults import FAULT_ENV, FAULT_EXIT_CODE
    from kiln.training.core.checkpoints import list_checkpoints
    from kiln.training.kd.job import checkpoint_digest

    home, plan, model_dir = tmp_path / "home", env["plan"], env["srv"].model_dir
    shutil.copytree(env["home"] / "data" / "runs" / "cap", home / "data" / "runs" / "cap",
                    ignore=shutil.ignore_patterns(".consumption"))  # an unconsumed copy of the capture
    body = {"adapter": "kd-crash", "run": "runs/cap", "batch_size": 1, "learning_rate": 2e-2, "lora_rank": 8,
            "seed": 1}
    ledger_dir = home / "data" / "runs" / "cap" / ".consumption"

    def crash_at(point: str) -> str:
        srv = start_server(model_dir, home, extra_args=[], env_extra={FAULT_ENV: point}, config=None)
        try:
            with httpx.Client(base_url=srv.base_url, timeout=60) as c:
                r = c.post("/v1/train/kd", json=body)
                assert r.status_code == 202, r.text
            assert srv.proc.wait(300) == FAULT_EXIT_CODE, srv.log()[-3000:]
        finally:
            if srv.proc.poll() is None:
                stop_server(srv)
        return r.json()["id"]

    before = []
    if after_reserve_first:
        first = crash_at("kd_job_after_reserve")
        assert [e["next_state"] for e in _events(ledger_dir / "shard-00000.t000.jsonl")] == ["reserved"]
        before = [("reserved", first), ("available", first)]
    second = crash_at("kd_job_after_checkpoint")
    shard0 = _events(ledger_dir / "shard-00000.t000.jsonl")
    assert [(e["next_state"], e["run_id"]) for e in shard0] == before + [("reserved", second)]
    assert not (ledger_dir / "shard-00001.t000.jsonl").exists()
    ckpt, = list_checkpoints(home / "training" / "jobs" / second / "checkpoints")

    srv = start_server(model_dir, home, extra_args=[], env_extra={}, config=None)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            assert c.get(f"/v1/train/jobs/{second}").json()["state"] == "failed"
            r = c.post("/v1/train/kd", json=body)  # a fresh job would retrain what the checkpoint holds
            assert r.status_code == 409 and r.json()["error"]["code"] == "capture_reserved", r.text
            assert second in r.json()["error"]["hint"]
            r = c.post("/v1/train/kd", json=body | {"resume_from_job": second})
            assert r.status_code == 202, r.text
            job = wait_job(c, r.json()["id"], timeout=120)
    finally:
        stop_server(srv)
    assert job["state"] == "succeeded", job.get("error")
    res = job["result"]
    assert res["resumed_from_step"] == 4 and res["report"]["steps"] == 8
    assert [s["action"] for s in res["report"]["shards"]] == ["reconciled", "trained"]
    shard0 = _events(ledger_dir / "shard-00000.t000.jsonl")
    assert [(e["next_state"], e["run_id"]) for e in shard0[len(before) + 1:]] == [("committed", second)]
    assert shard0[-1]["checkpoint_sha256"] == checkpoint_digest(ckpt)
    shard1 = _events(ledger_dir / "shard-00001.t000.jsonl")
    assert [(e["next_state"], e["run_id"]) for e in shard1] == [("reserved", job["id"]), ("committed", job["id"])]
