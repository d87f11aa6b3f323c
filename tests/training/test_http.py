"""End to end through a real `kiln serve` subprocess: correction served by the new adapter,
error envelopes, the CLI, a full queue, and a crash with a job running and one queued."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kiln.demo import CORRECTION, QUESTION, correction_body, wait_job
from tests.zygote import kiln_server
from kiln.runtime.builtin import BUILTIN_NAME

LONG = {"adapter": "long", "epochs": 1000, "checkpoint_interval": 5, "examples": [{"messages": [
    {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A long answer to train on."}]}]}


@pytest.fixture(scope="module")
def home(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    return home


def _chat(client, model):
    r = client.post("/v1/chat/completions", json={"model": model, "temperature": 0, "max_tokens": 24,
                                                   "messages": [{"role": "user", "content": QUESTION}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers.get("x-kiln-adapter-revision")


def _until(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _error(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    return body["error"]


def test_serve_train_errors_and_cli(home, tmp_path):
    """The default lane's end-to-end test: the correction loop, error envelopes and the CLI."""
    with kiln_server(home) as server:
        c = server.client
        base = c.get("/v1/models").json()["data"][0]["id"]
        before, _ = _chat(c, base)
        assert before != CORRECTION

        # The correction loop over HTTP: the job trains until the correction is the greedy answer.
        r = c.post("/v1/train/sft", json=correction_body("fix", QUESTION, CORRECTION))
        assert r.status_code == 202, r.text
        job = wait_job(c, r.json()["id"])
        assert job["state"] == "succeeded", job["error"]
        assert job["result"]["report"]["learned"] is True, job["result"]["report"]
        answer, revision = _chat(c, "fix")
        assert answer == CORRECTION and revision == job["result"]["revision"]
        assert _chat(c, base)[0] == before

        # Error envelopes.
        _error(c.post("/v1/train/sft", json={"adapter": "x"}), 400, "invalid_request")
        _error(c.post("/v1/train/sft", json={"adapter": "../x", "examples": []}), 400, "invalid_request")
        _error(c.post("/v1/train/sft", json={"adapter": "x", "dataset_path": "/etc/passwd"}), 400,
               "dataset_outside_data_dir")
        _error(c.post("/v1/train/grpo", json={"adapter": "g", "groups": [{"messages": [{"role": "user", "content": "q"}],
               "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 1}]}]}), 400, "zero_variance_groups")
        _error(c.get("/v1/train/jobs/job-0000000000000000"), 404, "job_not_found")
        _error(c.get("/v1/train/jobs/nonsense"), 404, "job_not_found")
        _error(c.delete(f"/v1/train/queue/{job['id']}"), 409, "job_finished")
        _error(c.post("/v1/train/sft", json={"adapter": "x", "dataset_path": "a\u0000b.jsonl"}), 400,
               "invalid_dataset_path")
        _error(c.post("/v1/train/sft", json={"adapter": "x", "dataset_path": "n" * 400}), 400, "invalid_dataset_path")

        # The CLI against the server: submit from a file, follow, then status.
        data = tmp_path / "fix.jsonl"
        data.write_text(json.dumps(correction_body("x", QUESTION, "Ants have six legs.")["examples"][0]) + "\n")
        kiln = [sys.executable, "-m", "kiln.cli"]
        out = subprocess.run(kiln + ["train", "sft", "--file", str(data), "--adapter", "cli-fix", "--url", server.url],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "published cli-fix revision" in out.stdout and "(serving now)" in out.stdout
        assert _chat(c, "cli-fix")[0] == "Ants have six legs."
        out = subprocess.run(kiln + ["train", "status", "--url", server.url], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, COLUMNS="200"))
        assert out.returncode == 0 and "cli-fix" in out.stdout and "succeeded" in out.stdout

        # The job's receipt (docs/adapters.md, "Training receipts"): published with the revision, checked by
        # `kiln adapters verify` against that revision and the served base model, carried by the download.
        _check_receipt(c, home, job, kiln)


def _check_receipt(c, home, job, kiln):
    import hashlib
    import io
    import tarfile

    from kiln import __version__
    from kiln.canonical import canonical_json_bytes

    rev = job["result"]["revision"]
    revdir = home / "adapters" / "fix" / "revisions" / rev
    manifest = json.loads((revdir / "kiln-manifest.json").read_bytes())
    raw = (revdir / "kiln-receipt.json").read_bytes()
    receipt = json.loads(raw)
    bound = receipt["adapter"]
    assert receipt["schema"] == "kiln.training-receipt.v1" and receipt["job_id"] == job["id"]
    assert (bound["name"], bound["revision"], bound["kind"]) == ("fix", rev, "sft")
    assert bound["manifest_sha256"] == hashlib.sha256((revdir / "kiln-manifest.json").read_bytes()).hexdigest()
    assert bound["base_model_sha256"] == manifest["base_model_sha256"]
    assert bound["config_sha256"] == hashlib.sha256(canonical_json_bytes(manifest["config"])).hexdigest()
    assert receipt["inputs"]["inputs_sha256"] == manifest["inputs_sha256"] and len(receipt["plan_sha256"]) == 64
    assert receipt["teacher"] is None and receipt["gate"] is None
    assert receipt["code"]["kiln_version"] == __version__
    env = dict(os.environ, KILN_HOME=str(home), COLUMNS="200")
    verify = kiln + ["adapters", "verify", "fix", "--base-model", str(home / "models" / BUILTIN_NAME)]
    ok = subprocess.run(verify, capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and rev in ok.stdout and job["id"] in ok.stdout, ok.stdout + ok.stderr
    download = c.get("/v1/adapters/fix/download")
    assert download.status_code == 200, download.text
    with tarfile.open(fileobj=io.BytesIO(download.content)) as tar:
        assert tar.extractfile("fix/kiln-receipt.json").read() == raw
    (revdir / "kiln-receipt.json").write_bytes(raw.replace(receipt["plan_sha256"].encode(), b"0" * 64))
    bad = subprocess.run(verify, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and "kiln-receipt.json" in bad.stderr, bad.stdout + bad.stderr
    (revdir / "kiln-receipt.json").write_bytes(raw)


@pytest.mark.slow
def test_crash_restart_and_resume(home):
    """SIGKILL with a job running and one queued; restart recovers, resumes once (a second resume is 409)."""
    env = {"KILN_TRAINING_QUEUE_MAX": "1"}
    with kiln_server(home, extra_env=env) as server:
        c = server.client

        # A running job, one queued job (queue_max 1), then 503.
        long_id = c.post("/v1/train/sft", json=LONG).json()["id"]
        _until(lambda: (c.get(f"/v1/train/jobs/{long_id}").json()["progress"].get("checkpoint_step") or 0) >= 5)
        queued = c.post("/v1/train/sft", json=correction_body("after", QUESTION, CORRECTION) | {"epochs": 2})
        assert queued.status_code == 202 and queued.json()["queue_position"] == 1
        _error(c.post("/v1/train/sft", json=correction_body("more", QUESTION, CORRECTION)), 503, "training_queue_full")
        status = c.get("/v1/train/status").json()
        assert status["running"]["id"] == long_id and [j["id"] for j in status["queued"]] == [queued.json()["id"]]
        running = c.get(f"/v1/train/jobs/{long_id}").json()
        assert running["step"] >= 5 and running["loss"] is not None and running["eta_s"] > 0

        server.process.send_signal(signal.SIGKILL)  # crash: no shutdown hooks run
        server.process.wait(30)

    with kiln_server(home, extra_env=env) as server:
        c = server.client
        crashed = c.get(f"/v1/train/jobs/{long_id}").json()
        assert crashed["state"] == "failed" and "interrupted" in crashed["error"]
        assert "resume_from_job" in crashed["error"]  # it had a checkpoint
        after = wait_job(c, queued.json()["id"])
        assert after["state"] == "succeeded", after["error"]
        # The interrupted job continues from its checkpoint when resubmitted.
        resumed = c.post("/v1/train/sft", json=LONG | {"resume_from_job": long_id})
        assert resumed.status_code == 202, resumed.text
        rid = resumed.json()["id"]
        _until(lambda: "resumed_from_step" in c.get(f"/v1/train/jobs/{rid}").json()["progress"])
        assert c.get(f"/v1/train/jobs/{rid}").json()["progress"]["resumed_from_step"] >= 5
        _error(c.post("/v1/train/sft", json=LONG | {"resume_from_job": long_id}), 409, "job_already_resumed")
        assert c.delete(f"/v1/train/queue/{rid}").status_code == 200
        assert wait_job(c, rid)["state"] == "cancelled"
