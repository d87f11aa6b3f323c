"""The /v1/evals API over a real `kiln serve`: suites (create, import, list, delete), validation
before anything runs, runs and comparisons with per-example pairing, cancel, strict replay across
a restart, the 0600 runs database, and the `kiln eval` CLI."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

from tests.zygote import kiln_server
from kiln.runtime.builtin import BUILTIN_NAME

RUN_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def home(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    return home


def suite(name: str, n: int = 6, **extra) -> dict:
    return {"name": name, "examples": [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}],
                                        "reference": str(2 * i)} for i in range(n)],
            "scorers": [{"type": "numeric"}, {"type": "regex", "pattern": r"\d"}],
            "generation": {"max_tokens": 6}, **extra}


def wait_run(c, run_id: str) -> dict:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        run = c.get(f"/v1/evals/runs/{run_id}").json()
        if run["state"] in ("succeeded", "failed", "cancelled"):
            return run
        assert time.monotonic() < deadline, f"{run_id} still {run['state']}"
        time.sleep(0.1)


def error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["message"]
    if code is not None:
        assert body["code"] == code, body
    return body


def test_evals_api(home, tmp_path):
    env = {"KILN_MODEL_THREADS": "2"}
    with kiln_server(home, extra_env=env) as server:
        c = server.client
        assert c.post("/v1/evals/suites", json=suite("arith")).status_code == 201
        error(c.post("/v1/evals/suites", json=suite("arith")), 409, "suite_exists")
        assert c.post("/v1/evals/suites?replace=true", json=suite("arith")).status_code == 201

        # Validation before anything runs: each a 4xx with the OpenAI envelope.
        error(c.post("/v1/evals/suites", json=suite("bad", scorers=[{"type": "regex", "pattern": "(a)\\1"}])),
              400, "invalid_regex")
        error(c.post("/v1/evals/suites", json=suite("bad", scorers=[{"type": "code"}])), 400,
              "code_execution_disabled")
        error(c.post("/v1/evals/suites", json=suite("bad", scorers=[
            {"type": "json_schema", "json_schema": {"$ref": "http://169.254.169.254/x"}}])), 400, "remote_ref")
        error(c.post("/v1/evals/suites", json=suite("../bad")), 400)
        error(c.post("/v1/evals/suites", json=suite("bad", scorers=[{"type": "nope"}])), 400)
        error(c.post("/v1/evals/runs", json={"suite": "missing"}), 404, "suite_not_found")
        error(c.post("/v1/evals/runs", json={"suite": "arith", "target": {"adapter": "nope"}}), 404,
              "adapter_not_found")
        error(c.post("/v1/evals/runs", json={}), 400)
        error(c.get("/v1/evals/runs/eval-0000000000000000"), 404, "eval_run_not_found")
        error(c.get("/v1/evals/runs/whatever"), 404, "eval_run_not_found")
        error(c.post("/v1/evals/replays", json={"run_id": "eval-0000000000000000"}), 404)
        error(c.post("/v1/train/sft", json={"adapter": "a", "auto_load": True, "post_eval": {"suite": "arith"},
                                            "examples": [{"messages": [{"role": "user", "content": "q"},
                                                                       {"role": "assistant", "content": "a"}]}]}),
              400)

        # JSONL import.
        rows = "\n".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"Say {w}"}],
                                     "reference": w}) for i, w in enumerate(["yes", "no", "maybe"]))
        r = c.post("/v1/evals/suites/import", json={"name": "say", "jsonl": rows, "scorers": [{"type": "contains"}],
                                                     "generation": {"max_tokens": 4}})
        assert r.status_code == 201, r.text
        assert r.json()["examples"] == 3
        error(c.post("/v1/evals/suites/import", json={"name": "x", "jsonl": "{not json", "scorers": [
            {"type": "exact"}]}), 400, "invalid_jsonl")
        names = [s["name"] for s in c.get("/v1/evals/suites").json()["data"]]
        assert names == ["arith", "say"]

        # A run on the base model, an inline suite with k samples, and a comparison.
        r = c.post("/v1/evals/runs", json={"suite": "arith"})
        assert r.status_code == 202, r.text
        run = wait_run(c, r.json()["id"])
        assert run["state"] == "succeeded", run["error"]
        res = run["result"]
        assert len(res["examples"]) == 6 and res["aggregate"]["examples"] == 6
        assert 0 <= res["aggregate"]["accuracy"] <= 1
        assert all(len(e["samples"]) == 1 and len(e["samples"][0]["scores"]) == 2 for e in res["examples"])
        prov = res["provenance"]
        assert prov["runtime"]["torch_threads"] == 2 and prov["candidate"]["adapter"] is None
        assert prov["seeds"] == [[i] for i in range(6)]

        inline = suite("inline", 4, generation={"max_tokens": 4, "temperature": 0.8, "samples": 3, "seed": 5},
                       aggregation="pass@k")
        run2 = wait_run(c, c.post("/v1/evals/runs", json={"inline_suite": inline}).json()["id"])
        assert run2["state"] == "succeeded", run2["error"]
        assert all(len(e["samples"]) == 3 for e in run2["result"]["examples"])
        assert run2["result"]["provenance"]["seeds"][1] == [8, 9, 10]

        cmp_ = wait_run(c, c.post("/v1/evals/comparisons", json={"suite": "say", "targets": [{}, {}]}).json()["id"])
        assert cmp_["state"] == "succeeded", cmp_["error"]
        out = cmp_["result"]
        assert len(out["runs"]) == 2 and [p["example"] for p in out["pairing"]] == ["r0", "r1", "r2"]
        # greedy and the same model twice: every pair is concordant
        assert out["pairwise_vs_first"][0]["numbers"]["candidate_only"] == 0
        assert out["pairwise_vs_first"][0]["numbers"]["baseline_only"] == 0
        error(c.post("/v1/evals/comparisons", json={"suite": "say", "targets": [{}] * 9}), 400)

        # Cancel: a long run is cancelled (queued or running), and a finished one cannot be.
        big = suite("big", 200, generation={"max_tokens": 200})
        rid = c.post("/v1/evals/runs", json={"inline_suite": big}).json()["id"]
        assert c.delete(f"/v1/evals/runs/{rid}").status_code == 200
        assert wait_run(c, rid)["state"] == "cancelled"
        error(c.delete(f"/v1/evals/runs/{rid}"), 409, "eval_run_finished")

        # Strict replay in the same environment matches.
        rep = wait_run(c, c.post("/v1/evals/replays", json={"run_id": run["id"]}).json()["id"])
        assert rep["result"]["replay"]["verdict"] == "matched", rep["result"]["replay"]

        # The CLI against the server.
        url = ["--url", server.url]
        kiln = [sys.executable, "-m", "kiln.cli", "eval"]
        out = subprocess.run([*kiln, "suites", "list", *url], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "arith" in out.stdout, out.stderr
        out = subprocess.run([*kiln, "run", "say", *url], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "passed" in out.stdout, out.stdout + out.stderr
        out = subprocess.run([*kiln, "show", run["id"], "--examples", *url], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and run["id"] in out.stdout
        assert "kiln_eval_runs_finished_total" in c.get("/metrics").text
        assert c.delete("/v1/evals/suites/say").status_code == 200
        error(c.get("/v1/evals/suites/say"), 404, "suite_not_found")

    db = home / "evals" / "runs.sqlite3"
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(db.parent).st_mode) == 0o700

    # After a restart with another thread count, the recorded environment no longer matches.
    with kiln_server(home, extra_env={"KILN_MODEL_THREADS": "1"}) as server:
        c = server.client
        assert c.get(f"/v1/evals/runs/{run['id']}").json()["state"] == "succeeded"
        rep = c.post("/v1/evals/replays", json={"run_id": run["id"]})
        assert rep.status_code == 202
        rep = wait_run(c, rep.json()["id"])
        replay = rep["result"]["replay"]
        assert replay["verdict"] == "mismatch" and replay["stage"] == "admission"
        assert {"field": "runtime.torch_threads", "recorded": 2, "now": 1} in replay["differences"]
