"""EvalService on the real engine (no HTTP): the local judge, the code scorer through a run,
k-sample aggregation, gate error verdicts, cancel of a queued run, restart settlement."""

from __future__ import annotations

import pytest

from kiln.evals import schemas as s
from kiln.evals.sandbox import landlock_abi
from kiln.evals.evaluation import _aggregate
from kiln.evals.service import EvalService


@pytest.fixture(scope="module")
def svc(builtin_model_dir, tmp_path_factory):
    from kiln.adapters.store import AdapterStore
    from kiln.config import load_settings
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model

    home = tmp_path_factory.mktemp("home")
    settings = load_settings(cli={"home": str(home), "eval.allow_code_execution": True}, environ={}).settings
    loaded = load_model(builtin_model_dir, device="cpu")
    engine = Engine(loaded, EngineConfig()).start()
    service = EvalService(engine=engine, store=AdapterStore(settings.adapters_path), settings=settings, model=loaded)
    service.start()
    yield service
    service.close()
    engine.stop()


def inline(scorers, n=3, **extra) -> s.SuiteSpec:
    return s.SuiteSpec.model_validate({"name": "t", "examples": [
        {"messages": [{"role": "user", "content": f"Write f returning {i}"}], "reference": f"assert f() == {i}"}
        for i in range(n)], "scorers": scorers, "generation": {"max_tokens": 6}, **extra})


def run(svc, suite, target=None):
    r = svc.submit_run(s.RunRequest(inline_suite=suite, target=target or s.Target()))
    return svc.wait(r["id"], 300)


def test_judge_scorer_on_the_base_model(svc):
    out = run(svc, inline([{"type": "judge", "max_tokens": 4}]))
    assert out["state"] == "succeeded", out["error"]
    for ex in out["result"]["examples"]:
        score = ex["samples"][0]["scores"][0]
        assert score["type"] == "judge" and isinstance(score["passed"], bool) and score["detail"]
    assert out["result"]["provenance"]["judges"] == [
        {"scorer": 0, "adapter": None, "revision": None, "base_model_sha256": svc.loaded.base_model_sha256}]


@pytest.mark.skipif(landlock_abi() < 1, reason="the code sandbox needs Linux Landlock")
def test_code_scorer_through_a_run(svc):
    out = run(svc, inline([{"type": "code", "timeout_s": 5}], n=2))
    assert out["state"] == "succeeded", out["error"]
    # the tiny model writes no valid f(): every sample fails, each with a reason
    assert all(not e["passed"] and e["samples"][0]["scores"][0]["detail"] for e in out["result"]["examples"])
    assert out["result"]["provenance"]["code_isolation"]["landlock_abi"] >= 1


def test_k_samples_and_aggregations(svc):
    suite = s.SuiteSpec.model_validate(inline([{"type": "contains"}], n=2).model_dump() | {
        "aggregation": "majority@k", "generation": {"max_tokens": 4, "temperature": 1.0, "samples": 3, "seed": 11}})
    out = run(svc, suite)
    assert out["state"] == "succeeded", out["error"]
    assert [[x["seed"] for x in e["samples"]] for e in out["result"]["examples"]] == [[11, 12, 13], [14, 15, 16]]
    sample = lambda text, ok: {"completion": text, "passed": ok}  # noqa: E731
    three = [sample("A", False), sample(" a", False), sample("B", True)]
    assert _aggregate("majority@k", three) == (False, 0.0)
    assert _aggregate("pass@k", three) == (True, 1.0)
    assert _aggregate("mean", three) == (False, pytest.approx(1 / 3))
    assert _aggregate("mean", three[1:]) == (True, 0.5)


def test_gate_errors_become_the_error_verdict(svc):
    v = svc.post_train_gate(s.AdapterRef(adapter="missing"), s.PostEval(suite="nope"))
    assert v["verdict"] == "error" and v["numbers"] is None and "suite_not_found" in v["reason"]
    svc.suites.put(inline([{"type": "exact"}]))
    v = svc.post_train_gate(s.AdapterRef(adapter="missing"), s.PostEval(suite="t"))
    assert v["verdict"] == "error" and "adapter_not_found" in v["reason"]


def test_restart_fails_runs_left_behind(svc, tmp_path):
    from kiln.evals.store import RunStore

    db = RunStore(tmp_path / "runs.sqlite3")
    queued = db.create("run", {"x": 1})
    running = db.create("run", {"x": 2})
    db.claim(running.id)
    db.close()
    again = RunStore(tmp_path / "runs.sqlite3")
    assert sorted(again.recovered) == sorted([queued.id, running.id])
    assert {again.get(queued.id).state, again.get(running.id).state} == {"failed"}
    again.close()
