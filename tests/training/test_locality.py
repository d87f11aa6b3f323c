"""Locality: the measure every job reports (kiln.training.core.locality), the guard that holds back activation
(kiln.adapters.locality_guard), the receipt's optional claim, and the whole loop through a real server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from kiln.adapters.locality_guard import (
    BELOW,
    NOT_MEASURED,
    GuardPolicy,
    LocalityBelowThreshold,
    check_locality,
    guard_verdict,
)
from kiln.demo import wait_job
from kiln.runtime.builtin import BUILTIN_NAME
from tests.evals.test_http import wait_run
from tests.zygote import kiln_server

FIGURES = {"probes": 10, "unchanged": 9, "unchanged_fraction": 0.9, "kl_mean": 0.02, "degenerate": 0}
HERON = [{"messages": [{"role": "user", "content": "Which bird guards the old mill?"},
                       {"role": "assistant", "content": "The old mill is guarded by a heron."}]}]
# a deliberately destructive job: a high learning rate for a few steps, without the KL-to-base anchor, wrecks
# the built-in model's other answers; scope "off" so the guard alone judges it (the default "auto" would scope it)
DESTRUCTIVE = {"adapter": "wrecked", "auto_load": True, "learning_rate": 0.05, "epochs": 10, "anchor_weight": 0,
               "examples": HERON, "scope": "off"}


# ------------------------------------------------------------------------------------------ the guard


def test_the_guard_admits_figures_over_the_thresholds_and_names_the_ones_under():
    policy = GuardPolicy()
    assert guard_verdict(FIGURES, policy)["admitted"] is True
    low = FIGURES | {"unchanged": 3, "unchanged_fraction": 0.3, "degenerate": 2}
    v = guard_verdict(low, policy)
    assert v["admitted"] is False and v["code"] == BELOW
    assert "3 of 10" in v["reason"] and "0.30 < min_unchanged 0.80" in v["reason"]
    assert "2 probe answers degenerate" in v["reason"]
    with pytest.raises(LocalityBelowThreshold) as exc:
        check_locality(low, policy)
    assert exc.value.status == 409 and exc.value.code == BELOW and exc.value.hint
    # the operator's override admits it and keeps the reason; a disabled guard does not judge
    assert guard_verdict(low, policy, override=True) | {} == v | {"admitted": True, "override": True}
    assert guard_verdict(low, GuardPolicy(enabled=False))["admitted"] is True
    # max_kl bounds the mean KL only when set
    assert guard_verdict(FIGURES, GuardPolicy(max_kl=0.01))["code"] == BELOW
    assert guard_verdict(FIGURES, GuardPolicy(max_kl=0.05))["admitted"] is True


def test_a_measure_that_failed_is_held_back_and_one_turned_off_is_not_judged():
    failed = guard_verdict({"error": "the locality measure failed: RuntimeError: x"}, GuardPolicy())
    assert failed["admitted"] is False and failed["code"] == NOT_MEASURED and "RuntimeError" in failed["reason"]
    assert guard_verdict({"probes": 0}, GuardPolicy())["code"] == NOT_MEASURED
    assert guard_verdict(None, GuardPolicy())["admitted"] is True


def test_policy_comes_from_the_config_section():
    from kiln.config import load_settings

    s = load_settings(cli={"locality.min_unchanged": 0.5, "locality.guard": False}, environ={}).settings
    assert GuardPolicy.from_settings(s.locality) == GuardPolicy(enabled=False, min_unchanged=0.5)
    assert GuardPolicy.from_settings(load_settings(cli={}, environ={}).settings.locality) == GuardPolicy()


# ------------------------------------------------------------------------------------------ the measure


@pytest.fixture(scope="module")
def peft(builtin_model_dir):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.training.core.templates import end_of_turn_ids
    from kiln.training.core.lora import add_private_adapter, lora_config

    tok = AutoTokenizer.from_pretrained(str(builtin_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(builtin_model_dir), dtype=torch.float32)
    end_ids = sorted(end_of_turn_ids(tok, model.generation_config))
    pm = get_peft_model(model, lora_config(4, 8, ["q_proj"]), adapter_name="placeholder")
    add_private_adapter(pm, "job", lora_config(8, 16, ["q_proj", "v_proj"]), seed=0)
    return pm, tok, end_ids


def test_an_untrained_adapter_changes_nothing_and_the_probe_set_is_cached(peft):
    """A fresh LoRA adapter (B = 0) is the base model: every answer unchanged, KL 0, nothing degenerate. The
    probe set is written once per base model and settings; the job's own prompts are added to it."""
    from kiln.training.core import locality as L

    pm, tok, end_ids = peft
    codec = L.text_codec(tok)
    kw = dict(base_model_sha256="test-base", probes=8, max_tokens=16, pad_id=end_ids[0], end_ids=end_ids)
    probes = L.probe_set(pm, codec, **kw)
    assert L.probe_set(pm, codec, **kw) is probes  # cached
    assert 0 < len(probes) <= 8 and probes.user == 0 and all(probes.answers)
    mine = L.probe_set(pm, codec, **kw | {"user_prompts": ["Which bird guards the old mill?"]})
    assert mine.user == 1 and mine.questions[-1] == "Which bird guards the old mill?"
    assert mine.questions[:-1] == probes.questions  # the same written questions, seeded
    figures = L.measure(pm, "job", mine, codec, max_tokens=16, pad_id=end_ids[0], end_ids=end_ids)
    assert figures["probes"] == len(mine) and figures["user_probes"] == 1
    assert figures["unchanged"] == len(mine) and figures["unchanged_fraction"] == 1.0
    assert figures["kl_mean"] == pytest.approx(0.0, abs=1e-6) and figures["degenerate"] == 0
    assert figures["changed"] == [] and figures["probe_set_sha256"] == mine.sha256
    assert pm.active_adapter == "placeholder"  # the previously active adapter is back


def test_a_wrecked_adapter_is_measured_as_changed(peft):
    """Large random LoRA weights: the measure sees changed answers and a positive KL (properties, not strings)."""
    from kiln.training.core import locality as L

    pm, tok, end_ids = peft
    codec = L.text_codec(tok)
    probes = L.probe_set(pm, codec, base_model_sha256="test-base", probes=8, max_tokens=16, pad_id=end_ids[0],
                         end_ids=end_ids)
    saved = {n: p.detach().clone() for n, p in pm.named_parameters() if ".job." in n}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".job." in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
    try:
        figures = L.measure(pm, "job", probes, codec, max_tokens=16, pad_id=end_ids[0], end_ids=end_ids)
    finally:
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
    assert figures["unchanged"] < figures["probes"] and figures["kl_mean"] > 0.1
    assert figures["changed"] and all(c["base"] != c["adapter"] for c in figures["changed"])


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def home(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    return home


def test_the_guard_holds_back_a_destructive_job_and_the_override_loads_it(home):
    """A job that wrecks the model's other answers is published with its locality but not served, with a typed
    reason naming the figures; the same job with locality.override is served. The figures reach the receipt,
    GET /v1/adapters and /metrics."""
    with kiln_server(home) as server:
        c = server.client
        job = wait_job(c, c.post("/v1/train/sft", json=DESTRUCTIVE).json()["id"])
        assert job["state"] == "succeeded", job["error"]
        result = job["result"]
        loc = result["locality"]
        assert loc["probes"] > 0 and loc["unchanged_fraction"] < 0.8 or loc["degenerate"] > 0, loc
        assert result["activated"] is False
        assert result["held_back"]["code"] == "locality_below_threshold"
        assert f"{loc['unchanged']} of {loc['probes']}" in result["held_back"]["reason"]
        assert loc["guard"]["admitted"] is False and loc["guard"]["override"] is False
        assert "wrecked" not in [m["id"] for m in c.get("/v1/models").json()["data"]]

        listed = {a["name"]: a for a in c.get("/v1/adapters").json()["data"]}["wrecked"]
        assert listed["active"] is False and listed["receipt"]["verified"] is True
        assert listed["receipt"]["locality"]["unchanged"] == loc["unchanged"]
        assert listed["receipt"]["locality"]["guard"] == {"admitted": False, "code": "locality_below_threshold",
                                                          "override": False}
        receipt = c.get("/v1/adapters/wrecked/receipt").json()
        assert receipt["locality"]["kl_mean"] == loc["kl_mean"]

        suite = {"name": "loc-probes", "scorers": [{"type": "exact"}], "examples": [
            {"messages": [{"role": "user", "content": q}], "reference": a} for q, a in (
                ("What is the capital of France?", "Paris"), ("How many legs does a spider have?", "Eight"))]}
        assert c.post("/v1/evals/suites", json=suite).status_code == 201
        missing = c.post("/v1/train/sft", json=DESTRUCTIVE | {"locality": {"eval_suite": "no-such-suite"}})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "suite_not_found", missing.text
        over = wait_job(c, c.post("/v1/train/sft", json=DESTRUCTIVE | {"adapter": "wrecked-anyway", "locality": {
            "override": True, "prompts": ["Which bird guards the old mill?"], "eval_suite": "loc-probes"}}).json()["id"])
        assert over["state"] == "succeeded", over["error"]
        assert over["result"]["activated"] is True and "held_back" not in over["result"]
        # the job's own prompt and the suite's two prompts are probes too (unless the base wrote the same question)
        assert 1 <= over["result"]["locality"]["user_probes"] <= 3
        assert over["result"]["locality"]["probes"] > over["result"]["locality"]["user_probes"]
        assert over["result"]["locality"]["guard"] | {} == {**over["result"]["locality"]["guard"],
                                                             "admitted": True, "override": True}
        assert "wrecked-anyway" in [m["id"] for m in c.get("/v1/models").json()["data"]]

        off = wait_job(c, c.post("/v1/train/sft", json=DESTRUCTIVE | {"adapter": "unmeasured", "locality": {
            "measure": False}}).json()["id"])
        assert off["result"]["locality"]["measured"] is False and off["result"]["activated"] is True

        metrics = c.get("/metrics").text
        assert 'kiln_training_locality_held_back_total{kind="sft"} 1.0' in metrics
        assert 'kiln_training_locality_unchanged_fraction_count{kind="sft"} 2.0' in metrics
        assert 'kiln_training_locality_last_degenerate{kind="sft"}' in metrics

        bad = c.post("/v1/train/sft", json=DESTRUCTIVE | {"locality": {"prompts": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"]


def test_with_the_default_scope_a_destructive_job_is_served_scoped_to_its_correction(home):
    """Scope "auto" (the default for inline corrections): a job that learns its correction and wrecks the other
    answers (the old defaults: lr 1e-2, no anchor, no weight decay), which the guard refuses unscoped, is published
    scoped to its correction and served; its correction is answered by the adapter and every other question by the
    base model, token for token. The destructive job above, which never learned its correction (fixed epochs, loss
    still high), is not routed to: with the default scope it is held back as before."""
    from kiln.serving.scope_routing import SCOPE_HEADER

    body = {"adapter": "wrecked-auto", "auto_load": True, "learning_rate": 0.01, "anchor_weight": 0,
            "weight_decay": 0, "examples": HERON}
    other = "What is the capital of France?"
    with kiln_server(home) as server:
        c = server.client

        def ask(model, q):
            r = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": q}],
                                                       "temperature": 0, "max_tokens": 24})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"].strip(), r.headers.get(SCOPE_HEADER)

        base_id = c.get("/v1/models").json()["data"][0]["id"]
        job = wait_job(c, c.post("/v1/train/sft", json=body).json()["id"])
        assert job["state"] == "succeeded", job["error"]
        result = job["result"]
        loc = result["locality"]
        unscoped = loc["auto_scope"]["unscoped"]
        assert unscoped["unchanged_fraction"] < 0.8 or unscoped["degenerate"] > 0, loc
        assert "locality guard" in loc["auto_scope"]["reason"]
        assert loc["guard"]["admitted"] is True and loc["guard"]["code"] is None
        assert loc["scope"]["out"] > 0 and loc["unchanged"] >= loc["scope"]["out"] and loc["degenerate"] == 0
        assert result["activated"] is True and "held_back" not in result
        config = c.get("/v1/adapters/wrecked-auto").json()["manifest"]["config"]
        assert config["scope"] == "corrections" and config["scope_auto"] == loc["auto_scope"]
        listed = {a["name"]: a for a in c.get("/v1/adapters").json()["data"]}["wrecked-auto"]
        assert listed["receipt"]["locality"]["auto_scope"] == loc["auto_scope"]  # the adapters page's badge reads it
        verify = subprocess.run([sys.executable, "-m", "kiln.cli", "adapters", "verify", "wrecked-auto",
                                 "--base-model", str(home / "models" / BUILTIN_NAME)], capture_output=True, text=True,
                                timeout=120, env=dict(os.environ, KILN_HOME=str(home), COLUMNS="200"))
        assert verify.returncode == 0 and "scoped to its corrections by scope auto" in verify.stdout, verify.stdout
        assert ask("wrecked-auto", "Which bird guards the old mill?") == ("The old mill is guarded by a heron.", "in")
        assert ask("wrecked-auto", other) == (ask(f"{base_id}@base", other)[0], "out")
        # an eval run (a post-train gate too) measures it as served: the base model answers out of scope, where
        # the unrouted weights would not
        probes = ["What is the capital of France?", "Where is the library?", "How many legs does a spider have?"]
        exact = [{"messages": [{"role": "user", "content": q}], "reference": a} for q, a in
                 [("Which bird guards the old mill?", "The old mill is guarded by a heron.")]
                 + [(q, ask(f"{base_id}@base", q)[0]) for q in probes]]
        r = c.post("/v1/evals/runs", json={"target": {"adapter": "wrecked-auto"}, "inline_suite": {
            "name": "as-served", "scorers": [{"type": "exact"}], "examples": exact,
            "generation": {"max_tokens": 24, "temperature": 0}}})
        assert r.status_code == 202, r.text
        run = wait_run(c, r.json()["id"])
        assert run["state"] == "succeeded", run["error"]
        got = [e["samples"][0]["completion"].strip() for e in run["result"]["examples"]]
        assert got == [e["reference"] for e in exact], got
        # as a local teacher it teaches what it serves: the base model scores the prompts out of its scope, so an
        # OPD student of it on such a prompt stays the base model there
        assert c.post("/v1/teachers", json={"alias": "wild", "kind": "local", "adapter": "wrecked-auto"}).status_code \
            == 201
        r = c.post("/v1/train/opd", json={"adapter": "wild-student", "teacher": "wild", "auto_load": True,
                                          "prompts": [{"messages": [{"role": "user", "content": other}]}],
                                          "locality": {"override": True}})
        assert r.status_code == 202, r.text
        student = wait_job(c, r.json()["id"])
        assert student["state"] == "succeeded", student["error"]
        assert ask("wild-student", other)[0] == ask(f"{base_id}@base", other)[0]
        unlearned = wait_job(c, c.post("/v1/train/sft", json={k: v for k, v in DESTRUCTIVE.items() if k != "scope"}
                                       | {"adapter": "wrecked-unlearned"}).json()["id"])
        assert unlearned["result"]["report"].get("learned") is not True
        assert unlearned["result"]["activated"] is False and "auto_scope" not in unlearned["result"]["locality"]
        assert unlearned["result"]["held_back"]["code"] == "locality_below_threshold"
