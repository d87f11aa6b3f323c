"""Scoped corrections through a real server (kiln.adapters.scope, kiln.serving.scope_routing): an adapter trained
with ``scope: "corrections"`` answers its corrected questions, and any other question addressed to it is answered
by the base model, exactly; the decision is on the response and in /metrics; a continuing job keeps the scope."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from kiln.demo import wait_job
from kiln.runtime.builtin import BUILTIN_NAME
from kiln.serving.scope_routing import SCOPE_HEADER
from tests.zygote import kiln_server

FACTS = [("Which bird guards the old mill?", "The old mill is guarded by a heron."),
         ("What is the name of the red boat?", "The red boat is called Marlow.")]
UNRELATED = ["What is the capital of France?", "Where is the library?", "How many legs does a spider have?"]


@pytest.fixture(scope="module")
def home(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    return home


def _ask(c, model: str, q: str):
    r = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": q}],
                                               "temperature": 0, "max_tokens": 32})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"].strip(), r.headers


def _scope_count(c, decision: str) -> float:
    m = re.search(rf'^kiln_scope_decisions_total{{decision="{decision}"}} (\S+)$', c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_scoped_adapter_answers_its_corrections_and_the_base_answers_the_rest(home, tmp_path):
    with kiln_server(home) as server:
        c = server.client
        base_id = c.get("/v1/models").json()["data"][0]["id"]
        base = {q: _ask(c, f"{base_id}@base", q)[0] for q in UNRELATED + [FACTS[1][0]]}
        for i, (q, a) in enumerate(FACTS):
            body = {"adapter": "scoped", "auto_load": True, "locality": {"override": True},
                    **({"base_adapter": "scoped"} if i else {"scope": "corrections"}),
                    "examples": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}]}
            r = c.post("/v1/train/sft", json=body)
            assert r.status_code == 202, r.text
            job = wait_job(c, r.json()["id"])
            assert job["state"] == "succeeded", job["error"]
            assert job["result"]["activated"] is True
            loc = job["result"]["locality"]  # measured as served: the base answers the probes out of scope
            assert loc["scope"]["in"] + loc["scope"]["out"] == loc["probes"] > 0 and loc["scope"]["out"] > 0
            assert loc["unchanged"] >= loc["scope"]["out"]
            config = c.get("/v1/adapters/scoped").json()["manifest"]["config"]
            assert config["scope"] == "corrections"  # the second job inherits it from its base adapter
            if i == 0:  # before the second correction its question is out of scope: the base answers it
                text, headers = _ask(c, "scoped", FACTS[1][0])
                assert headers[SCOPE_HEADER] == "out" and text == base[FACTS[1][0]]
        revision = c.get("/v1/adapters/scoped").json()["revision"]
        for q, a in FACTS:
            text, headers = _ask(c, "scoped", q)
            assert (text, headers[SCOPE_HEADER]) == (a, "in")
            assert headers["x-kiln-adapter-revision"] == revision
        for q in UNRELATED:
            text, headers = _ask(c, "scoped", q)
            assert headers[SCOPE_HEADER] == "out" and headers["x-kiln-adapter-revision"] == "base"
            assert text == base[q]
        assert _scope_count(c, "in") == 2 and _scope_count(c, "out") == 1 + len(UNRELATED)
        # completions are routed on their prompts: text, token IDs, and several prompts at once
        def complete(prompt):
            r = c.post("/v1/completions", json={"model": "scoped", "prompt": prompt, "temperature": 0,
                                                "max_tokens": 8})
            assert r.status_code == 200, r.text
            return [ch["text"] for ch in r.json()["choices"]], r.headers
        ids = c.post("/tokenize", json={"model": base_id, "prompt": UNRELATED[0]}).json()["tokens"]
        for prompt, verdict in [(FACTS[0][0], "in"), (UNRELATED[0], "out"), (ids, "out"),
                                ([FACTS[1][0], UNRELATED[1]], "mixed"), (UNRELATED[1:], "out")]:
            texts, headers = complete(prompt)
            assert headers[SCOPE_HEADER] == verdict, (prompt, verdict)
            assert headers["x-kiln-adapter-revision"] == ("base" if verdict == "out" else revision)
        base_text = c.post("/v1/completions", json={"model": f"{base_id}@base", "prompt": UNRELATED[0],
                                                    "temperature": 0, "max_tokens": 8}).json()["choices"][0]["text"]
        assert complete(UNRELATED[0])[0] == [base_text]
        assert _scope_count(c, "mixed") == 1
        # the base model's own ID and an unscoped adapter are never routed
        assert SCOPE_HEADER not in _ask(c, f"{base_id}@base", FACTS[0][0])[1]
        # a scoped job needs inline examples (the keys are its corrections)
        r = c.post("/v1/train/sft", json={"adapter": "x", "scope": "corrections", "dataset_path": "d.jsonl"})
        assert r.status_code in (400, 422), r.text
        r = c.post("/v1/train/sft", json={"adapter": "x", "base_adapter": "scoped", "dataset_path": "d.jsonl"})
        assert r.status_code == 400 and "scope" in r.text, r.text
        # the CLI's --scope
        data = tmp_path / "fix.jsonl"
        data.write_text(json.dumps({"messages": [{"role": "user", "content": FACTS[0][0]},
                                                 {"role": "assistant", "content": FACTS[0][1]}]}) + "\n")
        out = subprocess.run([sys.executable, "-m", "kiln.cli", "train", "sft", "--file", str(data), "--adapter",
                              "cli-scoped", "--scope", "corrections", "--url", server.url, "--locality-override"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert c.get("/v1/adapters/cli-scoped").json()["manifest"]["config"]["scope"] == "corrections"
        assert _ask(c, "cli-scoped", UNRELATED[0])[1][SCOPE_HEADER] == "out"
    # the keys are the revision's manifest: a restarted server routes as before
    with kiln_server(home) as server:
        c = server.client
        assert _ask(c, "scoped", FACTS[1][0])[1][SCOPE_HEADER] == "in"
        text, headers = _ask(c, "scoped", UNRELATED[0])
        assert headers[SCOPE_HEADER] == "out" and text == base[UNRELATED[0]]
