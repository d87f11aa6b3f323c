"""End to end over a real `kiln serve`: a 20-question suite on the built-in model; an SFT job with a
post-eval gate that teaches the right answers is promoted and activated; a job that teaches wrong
answers is refused with `regression` and the served adapter is unchanged."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln.demo import wait_job
from tests.zygote import kiln_server
from kiln.runtime.builtin import BUILTIN_NAME
from tests.evals.test_http import wait_run

WORDS = ["amber", "basil", "cedar", "delta", "ember", "fjord", "gecko", "heron", "igloo", "jade",
         "koala", "lemon", "mango", "nectar", "olive", "pearl", "quartz", "raven", "sage", "tulip"]
JOB_TIMEOUT_S = 240.0


def question(i: int) -> str:
    return f"What is secret word number {i}?"


def suite(n: int) -> dict:
    return {"name": "secret-words", "description": "which word goes with which number",
            "examples": [{"id": f"w{i}", "messages": [{"role": "user", "content": question(i)}],
                          "reference": WORDS[i % len(WORDS)]} for i in range(n)],
            "scorers": [{"type": "exact", "strip_punctuation": True}],
            "generation": {"temperature": 0, "max_tokens": 8}}


def sft(adapter: str, n: int, shift: int, post_eval: dict) -> dict:
    return {"adapter": adapter, "post_eval": post_eval, "examples": [
        {"messages": [{"role": "user", "content": question(i)},
                      {"role": "assistant", "content": WORDS[(i + shift) % len(WORDS)]}]} for i in range(n)]}


def _chat(client, model: str, i: int) -> tuple[str, str | None]:
    r = client.post("/v1/chat/completions", json={"model": model, "temperature": 0, "max_tokens": 8,
                                                   "messages": [{"role": "user", "content": question(i)}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers.get("x-kiln-adapter-revision")


def _gate_flow(tmp_path_factory, builtin_model_dir, n: int) -> dict:
    home = tmp_path_factory.mktemp("kiln-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    figures: dict = {}
    with kiln_server(home) as server:
        c = server.client
        base = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post("/v1/evals/suites", json=suite(n))
        assert r.status_code == 201, r.text
        assert c.post("/v1/evals/suites", json=suite(n)).status_code == 409
        assert [s["name"] for s in c.get("/v1/evals/suites").json()["data"]] == ["secret-words"]

        # 1. Teach the right answers; the gate against the base model promotes, activates and (opt-in) makes
        # the revision the server default adapter.
        r = c.post("/v1/train/sft", json=sft("words", n, 0, {"suite": "secret-words", "set_default_on_pass": True}))
        assert r.status_code == 400 and "activate_on_pass" in r.text, r.text  # only a served revision
        gate = {"suite": "secret-words", "min_accuracy": 0.6, "min_pairs": 20, "activate_on_pass": True,
                "set_default_on_pass": True}
        r = c.post("/v1/train/sft", json=sft("words", n, 0, gate))
        assert r.status_code == 202, r.text
        job = wait_job(c, r.json()["id"], timeout=JOB_TIMEOUT_S)
        assert job["state"] == "succeeded", job["error"]
        res = job["result"]
        verdict = res["post_eval"]
        assert verdict["verdict"] == "promoted", verdict
        assert res["activated"] is True and res["default_adapter"] is True
        default = c.get("/v1/adapters/default").json()["default"]
        assert (default["name"], default["revision"], default["serving"]) == ("words", res["revision"], True)
        nums = verdict["numbers"]
        assert nums["pairs"] == n and nums["candidate_only"] > nums["baseline_only"]
        assert nums["p_value"] < 0.05 and nums["wilson_lower"] >= 0.6
        figures["promoted"] = nums
        assert job["progress"]["post_eval"]["gate_run"] == verdict["gate_run"]
        good_revision = res["revision"]
        receipt = json.loads((home / "adapters" / "words" / "revisions" / good_revision / "kiln-receipt.json")
                             .read_text())
        assert receipt["gate"] == verdict  # the gate's verdict is recorded in the revision's training receipt
        models = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert "words" in models and not any(m.startswith("kiln-eval-") for m in models)
        for run_key, target in (("candidate_run", "words"), ("baseline_run", None)):
            run = c.get(f"/v1/evals/runs/{verdict[run_key]}").json()
            assert run["state"] == "succeeded" and run["result"]["target"]["adapter"] == target
            assert len(run["result"]["examples"]) == n
            prov = run["result"]["provenance"]
            assert prov["base_model_sha256"] and prov["suite_sha256"] and prov["runtime"]["torch"]
        cand_run = c.get(f"/v1/evals/runs/{verdict['candidate_run']}").json()
        assert cand_run["result"]["provenance"]["candidate"]["revision"] == good_revision
        # The served adapter answers what the candidate run recorded.
        first = cand_run["result"]["examples"][0]
        answer, rev = _chat(c, "words", 0)
        assert rev == good_revision and answer == first["samples"][0]["completion"]
        before = {i: _chat(c, "words", i)[0] for i in range(3)}

        # 2. Teach wrong answers; against the served adapter the gate says regression: nothing changes.
        gate = {"suite": "secret-words", "baseline": {"adapter": "words"}, "min_accuracy": 0.6,
                "activate_on_pass": True}
        r = c.post("/v1/train/sft", json=sft("words", n, 7, gate))
        assert r.status_code == 202, r.text
        job = wait_job(c, r.json()["id"], timeout=JOB_TIMEOUT_S)
        assert job["state"] == "succeeded", job["error"]
        verdict = job["result"]["post_eval"]
        assert verdict["verdict"] == "regression", verdict
        assert job["result"]["activated"] is False and "default_adapter" not in job["result"]
        assert c.get("/v1/adapters/default").json()["default"]["revision"] == good_revision
        assert _chat(c, base, 0) == (before[0], good_revision)  # the base model's ID answers with the default
        assert verdict["numbers"]["baseline_only"] > verdict["numbers"]["candidate_only"]
        figures["regression"] = verdict["numbers"]
        baseline_run = c.get(f"/v1/evals/runs/{verdict['baseline_run']}").json()
        assert baseline_run["result"]["target"]["revision"] == good_revision
        for i, text in before.items():
            assert _chat(c, "words", i) == (text, good_revision)

        # 3. Strict replay of the promoted candidate's run; metrics.
        r = c.post("/v1/evals/replays", json={"run_id": cand_run["id"]})
        assert r.status_code == 202, r.text
        replay = wait_run(c, r.json()["id"])
        assert replay["result"]["replay"]["verdict"] == "matched", replay["result"]["replay"]
        metrics = c.get("/metrics").text
        assert 'kiln_eval_gate_verdicts_total{verdict="promoted"} 1.0' in metrics
        assert 'kiln_eval_gate_verdicts_total{verdict="regression"} 1.0' in metrics
        assert "kiln_eval_run_duration_seconds_bucket" in metrics
    return figures


def test_post_train_gate_promotes_then_refuses_a_regression(tmp_path_factory, builtin_model_dir):
    figures = _gate_flow(tmp_path_factory, builtin_model_dir, 20)
    print("gate figures:", figures)


@pytest.mark.slow
def test_post_train_gate_on_a_larger_suite(tmp_path_factory, builtin_model_dir):
    _gate_flow(tmp_path_factory, builtin_model_dir, 40)
