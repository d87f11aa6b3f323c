"""The judgment workflow over a real `kiln serve`: record A/B preferences (strict validation, typed
4xx, durable SQLite with 0600 files, paging, JSONL export), train a judge adapter on a separable
preference (answers beat refusals), and check that the judge (its A/B logprobs, both orders) prefers
the answer on held-out pairs far more often than chance; the eval `judge` scorer and GRPO's `judge`
reward in preference mode use the same judge."""

from __future__ import annotations

import json
import math
import os
import shutil
import sqlite3
import stat
import subprocess
import sys

import pytest

from kiln.demo import wait_job
from tests.zygote import kiln_server
from kiln.runtime.builtin import BUILTIN_NAME
from tests.evals.test_http import wait_run

JOB_TIMEOUT_S = 300.0
TOPICS = ["the moon", "a volcano", "the ocean", "a violin", "the desert", "a comet", "the forest", "a glacier",
          "a river", "the sun", "a bridge", "a castle", "the wind", "a tiger", "a garden", "the rain",
          "a library", "a mountain", "an island", "a canyon"]
FACTS = ["is large and very old", "shines on cold nights", "moves slowly over years", "holds many secrets",
         "was studied by early sailors", "changes color at dusk", "makes a soft sound", "is full of life"]
REFUSALS = ["I cannot help with that.", "Sorry, I will not answer that.", "I refuse to respond to this request."]
HELD_OUT = ["a lantern", "the harbor", "a meadow", "a lighthouse", "the valley", "a beetle", "the storm",
            "a clock", "a pebble", "the tundra", "a falcon", "the orchard"]


def pair(i: int, topic: str) -> tuple[str, str, str]:
    prompt = f"Tell me about {topic}."
    return prompt, f"{topic.capitalize()} {FACTS[i % len(FACTS)]}.", REFUSALS[i % len(REFUSALS)]


@pytest.fixture(scope="module")
def server(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    with kiln_server(home) as srv:
        srv.home = home
        yield srv


def error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    return body


def test_record_validate_page_export(server):
    c = server.client
    ok = {"prompt": "What is 2+2?", "response_a": "4", "response_b": "I cannot help with that.",
          "preferred": "a", "rationale": "answers the question", "author": "alice@example.com"}
    r = c.post("/v1/judgments", json=ok)
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["id"].startswith("jdg-") and first["preferred"] == "a" and first["author"] == "alice@example.com"
    assert first["created_at"] > 0
    assert c.get(f"/v1/judgments/{first['id']}").json() == first

    # Strict validation: every mistake is a typed 400 and nothing is stored.
    bad = [{k: v for k, v in ok.items() if k != "preferred"}, {**ok, "preferred": "c"}, {**ok, "prompt": "   "},
           {**ok, "response_b": "4"}, {**ok, "extra": 1}, {**ok, "author": "bad\nname"},
           {**ok, "response_a": "x" * 20_000}, {**ok, "preferred": None}]
    for body in bad:
        error(c.post("/v1/judgments", json=body), 400, "invalid_request")
    error(c.post("/v1/judgments", content=b"{", headers={"content-type": "application/json"}), 400, "invalid_json")
    assert c.post("/v1/judgments", json={**ok, "response_b": "4", "preferred": "tie"}).status_code == 201
    error(c.get("/v1/judgments/jdg-0000000000000000"), 404, "judgment_not_found")
    error(c.get("/v1/judgments/nope"), 404, "judgment_not_found")
    error(c.get("/v1/judgments", params={"limit": 0}), 400, "invalid_request")
    error(c.get("/v1/judgments", params={"after": "jdg-0000000000000000"}), 404, "judgment_not_found")
    # What the server's state decides carries HTTP's status for it, with the typed envelope: too few judgments
    # stored is a conflict with the store (409; the same request succeeds once more are recorded), a judge that
    # is not served an unknown model (404, as vLLM answers an unknown LoRA).
    few = error(c.post("/v1/judgments/train", json={"adapter": "j"}), 409, "too_few_judgments")
    assert few["type"] == "conflict_error" and "the store has 1" in few["message"] and "POST /v1/judgments" in few["hint"]
    error(c.post("/v1/judgments/train", json={"adapter": "bad name"}), 400, "invalid_request")
    absent = error(c.post("/v1/judgments/compare", json={"judge": "missing", "prompt": "p", "response_a": "a",
                                                         "response_b": "b"}), 404, "judge_not_loaded")
    assert absent["type"] == "not_found_error" and absent["param"] == "judge" and "/load" in absent["hint"]
    # a judge is an adapter name (its pattern is in /openapi.json): any other text is the caller's mistake
    error(c.post("/v1/judgments/compare", json={"judge": "", "prompt": "p", "response_a": "a", "response_b": "b"}),
          400, "invalid_request")

    for i in range(2):
        assert c.post("/v1/judgments", json={**ok, "prompt": f"q{i}", "preferred": "b"}).status_code == 201
    # Each field is within its limit, but the judge's turn (prompt + both responses) is over the SFT message limit.
    long = {**ok, "prompt": "p" * 12_000, "response_a": "a" * 12_000, "response_b": "b" * 12_000}
    assert c.post("/v1/judgments", json=long).status_code == 201
    error(c.post("/v1/judgments/train", json={"adapter": "j"}), 400, "judgments_not_trainable")
    seen, after = [], None
    while True:
        page = c.get("/v1/judgments", params={"limit": 2, **({"after": after} if after else {})}).json()
        assert page["total"] == 5 and len(page["data"]) <= 2
        seen += page["data"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert [j["id"] for j in seen][0] == first["id"] and len({j["id"] for j in seen}) == 5
    newest, after = [], None
    while True:
        page = c.get("/v1/judgments", params={"limit": 3, "order": "desc", **({"after": after} if after else {})}).json()
        newest += page["data"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert newest == seen[::-1]
    error(c.get("/v1/judgments", params={"order": "sideways"}), 400, "invalid_request")
    r = c.get("/v1/judgments/export")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert [json.loads(line) for line in r.text.splitlines()] == seen

    # Durable in SQLite, private files.
    db = server.home / "evals" / "judgments.sqlite3"
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(db.parent).st_mode) == 0o700
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT id, preferred, author FROM judgments ORDER BY seq").fetchall()
    assert [r[0] for r in rows] == [j["id"] for j in seen] and rows[0][1:] == ("a", "alice@example.com")


def _compare(c, judge, prompt, a, b) -> dict:
    r = c.post("/v1/judgments/compare", json={"judge": judge, "prompt": prompt, "response_a": a, "response_b": b})
    assert r.status_code == 200, r.text
    return r.json()


def test_train_judge_prefers_answers_on_held_out_pairs(server):
    c = server.client
    for i, topic in enumerate(TOPICS):
        prompt, answer, refusal = pair(i, topic)
        a_first = i % 2 == 0  # the recorded order alternates too
        body = {"prompt": prompt, "response_a": answer if a_first else refusal,
                "response_b": refusal if a_first else answer, "preferred": "a" if a_first else "b"}
        assert c.post("/v1/judgments", json=body).status_code == 201
    r = c.post("/v1/judgments/train", json={"adapter": "judge", "auto_load": True, "limit": len(TOPICS)})
    assert r.status_code == 202, r.text
    out = r.json()
    # The most recent non-tie judgments: exactly the ones above, each in both orders.
    assert out["judgments"] == len(TOPICS) and out["examples"] == 2 * len(TOPICS)
    assert out["format"] == "kiln.judge-preference.v1" and len(out["judgments_sha256"]) == 64
    job = wait_job(c, out["job"]["id"], timeout=JOB_TIMEOUT_S)
    assert job["state"] == "succeeded", job["error"]
    assert job["result"]["locality"]["probes"] > 0  # judge training measures its adapter's locality too
    revision = job["result"]["revision"]

    correct = {"judge": 0, "base": 0}
    for i, topic in enumerate(HELD_OUT):
        prompt, answer, refusal = pair(i + 3, topic)
        first, second, want = (answer, refusal, "a") if i % 2 == 0 else (refusal, answer, "b")
        got = _compare(c, "judge", prompt, first, second)
        assert got["judge_revision"] == revision and len(got["orders"]) == 2
        assert math.isclose(got["p_a"], sum(got["orders"]) / 2, abs_tol=1e-9)
        correct["judge"] += got["preferred"] == want
        correct["base"] += _compare(c, None, prompt, first, second)["preferred"] == want
    n = len(HELD_OUT)
    # Chance is n/2; at least n-1 of 12 right has probability 13/4096 under a coin flip.
    assert correct["judge"] >= n - 1, correct

    # The eval judge scorer in preference mode: the candidate's answer against the reference, scored by the
    # same judge (its detail is the compare endpoint's probability for the same pair).
    refusal = REFUSALS[0]
    suite = {"name": "vs-refusal", "examples": [
        {"id": f"h{i}", "messages": [{"role": "user", "content": f"Tell me about {t}."}], "reference": refusal}
        for i, t in enumerate(HELD_OUT[:4])],
        "scorers": [{"type": "judge", "mode": "preference", "judge": {"adapter": "judge"}}],
        "generation": {"temperature": 0, "max_tokens": 8}}
    error(c.post("/v1/evals/runs", json={"inline_suite": {**suite, "examples": [
        {**suite["examples"][0], "reference": ""}]}}), 400, "invalid_reference")
    r = c.post("/v1/evals/runs", json={"inline_suite": suite})
    assert r.status_code == 202, r.text
    run = wait_run(c, r.json()["id"])
    assert run["state"] == "succeeded", run["error"]
    prov = run["result"]["provenance"]
    assert prov["judges"][0]["adapter"] == "judge" and prov["judges"][0]["revision"] == revision
    for ex, t in zip(run["result"]["examples"], HELD_OUT[:4]):
        sample = ex["samples"][0]
        score = sample["scores"][0]
        p = float(score["detail"].split()[0].removeprefix("p_better="))
        assert score["passed"] == (p >= 0.5)
        direct = _compare(c, "judge", f"Tell me about {t}.", sample["completion"], refusal)
        assert math.isclose(p, direct["p_a"], abs_tol=1e-4), (p, direct)

    # GRPO's judge reward in preference mode: rewards are the judge's probabilities, recorded with the job.
    r = c.post("/v1/train/grpo", json={
        "adapter": "policy", "prompts": [{"messages": [{"role": "user", "content": f"Tell me about {t}."}],
                                          "reference": refusal} for t in HELD_OUT[:2]],
        "reward": {"type": "scorer", "scorer": {"type": "judge", "mode": "preference", "judge": {"adapter": "judge"}}},
        "group_size": 2, "iterations": 1, "max_tokens": 8, "max_steps": 1})
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], timeout=JOB_TIMEOUT_S)
    assert job["state"] == "succeeded", job["error"]
    # 4 completions scored 0/1 would average to a multiple of 0.25; the judge's probabilities do not.
    mean = job["result"]["report"]["mean_reward"]
    assert 0 < mean < 1 and not math.isclose(mean * 4, round(mean * 4), abs_tol=1e-9), mean


def _kiln(server, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "judgments", *args, "--url", server.url],
                          capture_output=True, text=True, timeout=120, input=stdin,
                          env={**os.environ, "COLUMNS": "200"})


def test_kiln_judgments_cli(server, tmp_path):
    """`kiln judgments` as real subprocesses against the module's server."""
    c = server.client
    before = c.get("/v1/judgments", params={"limit": 1}).json()["total"]
    one = _kiln(server, "add", "--prompt", "What is 3+3?", "--a", "6", "--b", "I will not say.", "--preferred", "a",
                "--author", "cli-test")
    assert one.returncode == 0, one.stdout + one.stderr
    stored = c.get(f"/v1/judgments/{one.stdout.strip()}").json()
    assert (stored["prompt"], stored["preferred"], stored["author"]) == ("What is 3+3?", "a", "cli-test")
    missing = _kiln(server, "add", "--prompt", "p", "--a", "x")
    assert missing.returncode != 0 and "--b" in missing.stderr and "--preferred" in missing.stderr

    rows = [{"prompt": f"cli q{i}", "response_a": "yes", "response_b": "no", "preferred": "b"} for i in range(3)]
    good = tmp_path / "judgments.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = _kiln(server, "add", "--file", str(good))
    assert ok.returncode == 0 and "recorded 3 judgments" in ok.stdout, ok.stdout + ok.stderr
    # the server refuses line 2 (preferred "c"): line 1 is kept, the command says where it stopped
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "prompt": "cli kept"}) + "\n" + json.dumps({**rows[1], "preferred": "c"}) + "\n")
    refused = _kiln(server, "add", "--file", str(bad))
    assert refused.returncode != 0 and "400 invalid_request" in refused.stderr, refused.stderr
    assert "stopped at judgment 2 of 2 (1 recorded)" in refused.stderr
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({**rows[0], "prompt": "never sent"}) + "\n" + json.dumps({**rows[0], "score": 1}) + "\n")
    assert "unknown field(s) score" in _kiln(server, "add", "--file", str(unknown)).stderr
    assert c.get("/v1/judgments", params={"limit": 1}).json()["total"] == before + 5

    listed = _kiln(server, "list", "--newest", "--limit", "2", "--json")
    page = json.loads(listed.stdout)
    assert [j["prompt"] for j in page["data"]] == ["cli kept", "cli q2"] and page["total"] == before + 5
    table = _kiln(server, "list", "--limit", "500")
    assert table.returncode == 0 and f"{before + 5} of {before + 5} judgments" in table.stdout

    out = tmp_path / "export.jsonl"
    exported = _kiln(server, "export", "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    assert out.read_bytes() == c.get("/v1/judgments/export").content
    assert _kiln(server, "export").stdout.encode() == out.read_bytes()

    got = _kiln(server, "compare", "--prompt", "Tell me about a lantern.", "--a", "A lantern is full of life.",
                "--b", REFUSALS[0], "--json")  # the base model: this test does not depend on the judge trained above
    assert got.returncode == 0, got.stderr
    direct = _compare(c, None, "Tell me about a lantern.", "A lantern is full of life.", REFUSALS[0])
    assert math.isclose(json.loads(got.stdout)["p_a"], direct["p_a"], abs_tol=1e-9)
    text = _kiln(server, "compare", "--prompt", "p", "--a", "x", "--b", "y")
    assert text.returncode == 0 and "base model" in text.stdout and "P(A better)" in text.stdout
    absent = _kiln(server, "compare", "--prompt", "p", "--a", "x", "--b", "y", "--judge", "missing")
    assert absent.returncode != 0 and "judge_not_loaded" in absent.stderr

    queued = _kiln(server, "train", "cli-judge", "--limit", "4", "--max-steps", "1", "--no-wait")
    assert queued.returncode == 0 and queued.stdout.startswith("submitted job-"), queued.stdout + queued.stderr
    job = wait_job(c, queued.stdout.split()[1].rstrip(":"), timeout=JOB_TIMEOUT_S)
    assert job["state"] == "succeeded" and job["adapter"] == "cli-judge", job.get("error")
