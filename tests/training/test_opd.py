"""On-policy distillation end to end through a real `kiln serve` on 127.0.0.1.

The teacher is this server's own model with an SFT-trained adapter (a `local`
teacher: same identity rules, no HTTP hop). The student is a fresh adapter on
the base model, trained by OPD on its own samples. The property checked: with the
request defaults, the student's greedy answer becomes the teacher's (never shown
to the student as a target) and its log-likelihood reaches the teacher's.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.demo import CORRECTION, QUESTION, correction_body, wait_job
from tests.serving.conftest import start_server, stop_server
from tests.training.job_control import cancel_after_checkpoint

MSGS = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("opd-home")


@pytest.fixture(scope="module")
def srv(builtin_model_dir, home):
    s = start_server(builtin_model_dir, home, extra_args=[], env_extra={}, config=None)
    yield s
    stop_server(s)


def _answer_logprob(c: httpx.Client, model: str, prompt_ids: list[int], answer_ids: list[int]) -> float:
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt_ids + answer_ids, "max_tokens": 1,
                                        "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    return sum(rows[len(prompt_ids) + j][str(t)]["logprob"] for j, t in enumerate(answer_ids))


@pytest.fixture(scope="module")
def tutor(srv):
    c = httpx.Client(base_url=srv.base_url, timeout=120)
    job = c.post("/v1/train/sft", json=correction_body("tutor-adapter", QUESTION, CORRECTION)).json()
    assert wait_job(c, job["id"], timeout=300)["state"] == "succeeded"
    r = c.post("/v1/teachers", json={"alias": "tutor", "kind": "local", "adapter": "tutor-adapter"})
    assert r.status_code == 201, r.text
    assert r.json()["identity"]["adapter"] is not None
    return c


def test_opd_refusals_before_queueing(tutor):
    c = tutor
    base = {"adapter": "s", "teacher": "tutor", "prompts": [{"messages": MSGS}]}
    assert c.post("/v1/train/opd", json=base | {"teacher": "nobody"}).status_code == 404
    r = c.post("/v1/train/opd", json=base | {"top_k": 10_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "top_k_too_large"
    assert c.post("/v1/train/opd", json=base | {"training_mode": "off_policy"}).status_code == 400
    off = {"adapter": "s", "teacher": "tutor", "training_mode": "off_policy", "teacher_jsonl": "t.jsonl"}
    r = c.post("/v1/train/opd", json=off | {"rehearsal": 4})  # rehearsal rows are on-policy only
    assert r.status_code == 400 and "rehearsal" in r.text
    # CE needs a target: a `gold` on every prompt, or the teacher path (on by default)
    assert c.post("/v1/train/opd", json=base | {"ce_weight": 1.0, "teacher_path": False}).status_code == 400
    assert c.post("/v1/train/opd", json=base | {"loss": "jsd"}).status_code == 400
    assert c.post("/v1/train/opd", json=base | {"prompts": [{"messages": MSGS + [
        {"role": "assistant", "content": "x"}]}]}).status_code == 400


MILL_Q = "Which bird guards the old mill?"
MILL_A = "The old mill is guarded by a heron."


def _greedy(c: httpx.Client, model: str, msgs: list[dict]) -> str:
    r = c.post("/v1/chat/completions", json={"model": model, "messages": msgs, "temperature": 0, "max_tokens": 32})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _max_token_run(c: httpx.Client, text: str) -> int:
    ids = c.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    best = run = 0
    for i, t in enumerate(ids):
        run = run + 1 if i and t == ids[i - 1] else 1
        best = max(best, run)
    return best


def test_opd_request_defaults_make_the_teachers_answer_the_students(srv, tutor):
    """Issue 34's acceptance: a teacher that learned one answer (an SFT adapter, a `local` teacher); OPD with
    nothing but the request defaults; the student's greedy answer (what a user sees) becomes the teacher's,
    its log-likelihood of that answer reaches the teacher's, and it does not collapse into repetition."""
    import math

    from kiln.training.opd.schemas import (
        DEFAULT_OPD_ANCHOR_WEIGHT,
        DEFAULT_OPD_PATH_CE_WEIGHT,
        DEFAULT_OPD_REHEARSAL,
        DEFAULT_OPD_TOKEN_BUDGET,
        OPDRequest,
    )

    c = tutor
    msgs = [{"role": "user", "content": MILL_Q}]
    job = c.post("/v1/train/sft", json=correction_body("mill-adapter", MILL_Q, MILL_A)).json()
    assert wait_job(c, job["id"], timeout=300)["state"] == "succeeded"
    r = c.post("/v1/teachers", json={"alias": "mill", "kind": "local", "adapter": "mill-adapter"})
    assert r.status_code == 201, r.text
    answer = _greedy(c, "mill-adapter", msgs)
    prompt_ids = c.post("/tokenize", json={"messages": msgs, "add_generation_prompt": True}).json()["tokens"]
    answer_ids = c.post("/tokenize", json={"prompt": answer, "add_special_tokens": False}).json()["tokens"]
    before = _answer_logprob(c, srv.model_id, prompt_ids, answer_ids)
    teacher_lp = _answer_logprob(c, "mill-adapter", prompt_ids, answer_ids)
    assert teacher_lp > before + 20 and _greedy(c, srv.model_id, msgs) != answer  # only the teacher knows it

    # the defaults as a user sends them: no locality override (issue 48: the anchor, on by default, keeps the
    # student local enough for the guard to serve it)
    r = c.post("/v1/train/opd", json={"adapter": "mill-student", "teacher": "mill", "prompts": [{"messages": msgs}],
                                      "auto_load": True})
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], timeout=600)
    assert job["state"] == "succeeded", job.get("error")
    assert job["kind"] == "opd"
    loc = job["result"]["locality"]
    assert loc["probes"] > 0 and loc["kl_mean"] >= 0  # every kind measures
    assert job["result"]["activated"] is True and "held_back" not in job["result"], job["result"]
    assert loc["guard"]["admitted"] is True and not loc["guard"].get("override") and loc["degenerate"] == 0, loc
    rep = job["result"]["report"]
    f = OPDRequest.model_fields  # a one-prompt job trains up to the token budget, not one step...
    per_step = f["samples_per_prompt"].default * f["max_tokens"].default
    config = c.get("/v1/adapters/mill-student").json()["manifest"]["config"]
    assert config["steps"] == math.ceil(DEFAULT_OPD_TOKEN_BUDGET / per_step) > 1 and config["until_learned"] is True
    assert config["teacher_path"] is True and config["ce_weight"] == DEFAULT_OPD_PATH_CE_WEIGHT > 0
    # rehearsal (on by default): questions the base model wrote itself, answered by it, trained beside the samples
    assert config["rehearsal"] == DEFAULT_OPD_REHEARSAL > 0
    assert config["anchor_weight"] == DEFAULT_OPD_ANCHOR_WEIGHT > 0 and rep["anchor_rows"] > 0, rep  # and the anchor
    assert rep["rehearsal_rows"] >= 1 and rep["rehearsal_tokens"] >= rep["steps"], rep
    # ...and stops once the teacher's greedy answer (its teacher path, scored beside the samples, with CE on it)
    # is the student's: in process 8 steps with that CE, 27-32 with the path row alone, 42-57 with neither
    # (bench/opd_transfer.py)
    assert rep["learned"] is True and 1 < rep["steps"] == rep["learned_at_step"] <= 60, rep
    assert rep["teacher_path_tokens"] == len(answer_ids) + 1 and rep["teacher_path_rounds"] >= 1, rep
    assert rep["teacher_s"] > 0 and rep["student_s"] > 0
    after = _answer_logprob(c, "mill-student", prompt_ids, answer_ids)
    greedy = _greedy(c, "mill-student", msgs)
    assert greedy == answer, (greedy, answer, before, after, teacher_lp, rep)
    # measured in process (bench/opd_transfer.py): the student ends within 0.1 nats of the teacher
    assert after > teacher_lp - 0.05 * (teacher_lp - before), (before, after, teacher_lp, rep)
    # the last step's samples (4 x 24 tokens) stay mostly inside the teacher's top-K; the collapse this
    # issue reported drove that share to 0.76-0.85
    assert rep["outside_top_k"] < 0.3, rep
    # no repetition collapse: answers sampled as in training do not repeat a token 4+ times in a row
    for seed in range(4):
        r = c.post("/v1/chat/completions", json={"model": "mill-student", "messages": msgs,
                                                 "temperature": f["temperature"].default,
                                                 "max_tokens": 32, "seed": seed})
        assert _max_token_run(c, r.json()["choices"][0]["message"]["content"]) < 4
    info = c.get("/v1/adapters/mill-student").json()
    assert "opd" in str(info)


def _adapter_scores(c: httpx.Client, model: str) -> list[float]:
    r = c.post("/v1/completions", json={"model": model, "prompt": list(range(3, 40)), "max_tokens": 1,
                                        "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    return [max(v["logprob"] for v in row.values()) for row in r.json()["choices"][0]["prompt_logprobs"][1:]]


def test_opd_resume_equals_uninterrupted(tutor):
    c = tutor
    body = {"teacher": "tutor", "prompts": [{"messages": MSGS}], "samples_per_prompt": 2, "max_tokens": 8,
            "top_k": 4, "steps": 60, "learning_rate": 3e-3, "batch_size": 1, "checkpoint_interval": 5,
            "auto_load": True, "locality": {"override": True}}  # held back by the locality guard otherwise (docs/training.md, "Locality")
    whole = wait_job(c, c.post("/v1/train/opd", json=body | {"adapter": "whole"}).json()["id"], timeout=600)
    assert whole["state"] == "succeeded", whole.get("error")
    job = c.post("/v1/train/opd", json=body | {"adapter": "parted"}).json()
    cancel_after_checkpoint(c, job["id"], 5, timeout=600, poll_s=0.02)
    resumed = wait_job(c, c.post("/v1/train/opd", json=body | {"adapter": "parted", "resume_from_job": job["id"]})
                       .json()["id"], timeout=600)
    assert resumed["state"] == "succeeded", resumed.get("error")
    assert resumed["result"]["resumed_from_step"] >= 5
    a, b = _adapter_scores(c, "whole"), _adapter_scores(c, "parted")
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_opd_with_remote_kiln_teacher_batched_scoring(srv, tutor):
    """The same server registered as a remote/kiln teacher over loopback HTTP: probes, then a short OPD job
    whose teacher scores each step's samples in one batched /v1/completions request."""
    c = tutor
    r = c.post("/v1/teachers", json={"alias": "tutor-http", "kind": "remote", "provider": "kiln",
                                     "model_id": "tutor-adapter", "url": srv.base_url})
    assert r.status_code == 201, r.text
    assert r.json()["fingerprint"] == c.get("/v1/teachers/tutor").json()["fingerprint"]  # same identity
    body = {"adapter": "student-http", "teacher": "tutor-http", "prompts": [{"messages": MSGS}],
            "samples_per_prompt": 3, "max_tokens": 8, "top_k": 4, "steps": 4, "batch_size": 1, "loss": "tail",
            "rehearsal": 0}
    job = wait_job(c, c.post("/v1/train/opd", json=body).json()["id"], timeout=600)
    assert job["state"] == "succeeded", job.get("error")
    assert job["result"]["report"]["teacher_s"] > 0
    assert "rehearsal_rows" not in job["result"]["report"]  # rehearsal 0: no rehearsal rows trained


def test_opd_post_eval_gate_decides_activation(tutor):
    """post_eval on an OPD job: the published adapter is evaluated against the base model by the evals gate
    (as for SFT), the verdict is in the job result, and the adapter is activated only on `promoted`."""
    c = tutor
    answer = c.post("/v1/chat/completions", json={"model": "tutor-adapter", "messages": MSGS, "temperature": 0,
                                                  "max_tokens": 16}).json()["choices"][0]["message"]["content"]
    suite = {"name": "opd-gate", "examples": [{"id": "q", "messages": MSGS, "reference": answer}],
             "scorers": [{"type": "exact", "strip_punctuation": True}],
             "generation": {"temperature": 0, "max_tokens": 16}}
    assert c.post("/v1/evals/suites", json=suite).status_code == 201
    body = {"adapter": "student-gated", "teacher": "tutor", "prompts": [{"messages": MSGS}], "samples_per_prompt": 2,
            "max_tokens": 8, "top_k": 4, "steps": 3, "batch_size": 1,
            "post_eval": {"suite": "opd-gate", "min_pairs": 1, "min_accuracy": 0.0, "activate_on_pass": True}}
    assert c.post("/v1/train/opd", json=body | {"auto_load": True}).status_code == 400  # post_eval owns activation
    r = c.post("/v1/train/opd", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], timeout=600)
    assert job["state"] == "succeeded", job.get("error")
    res = job["result"]
    verdict = res["post_eval"]
    assert verdict["verdict"] in ("promoted", "kept", "regression", "demoted", "inconclusive"), verdict
    assert res["activated"] == (verdict["verdict"] == "promoted")
    cand = c.get(f"/v1/evals/runs/{verdict['candidate_run']}").json()
    assert cand["result"]["target"]["adapter"] == "student-gated"
    assert cand["result"]["provenance"]["candidate"]["revision"] == res["revision"]
    assert job["progress"]["post_eval"]["gate_run"] == verdict["gate_run"]
    active = {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert ("student-gated" in active) == res["activated"]


def _scored_row(c: httpx.Client, prompt_ids: list[int], completion: list[int], top_k: int) -> dict:
    """One teacher JSONL row: the teacher (tutor-adapter) scores prompt + completion, as the manifest says."""
    r = c.post("/v1/completions", json={"model": "tutor-adapter", "prompt": prompt_ids + completion, "max_tokens": 1,
                                        "prompt_logprobs": top_k})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    return {"token_ids": prompt_ids + completion, "prompt_len": len(prompt_ids),
            "prompt_logprobs": [None if row is None else {k: v["logprob"] for k, v in row.items()} for row in rows]}


def test_opd_off_policy_from_identity_bound_teacher_jsonl(srv, tutor, home):
    """A teacher JSONL built from the alias's off_policy_manifest trains the student toward the teacher without
    sampling; a corpus bound to another fingerprint is 409 naming the field, malformed rows are 400."""
    import json

    c = tutor
    manifest = c.get("/v1/teachers/tutor").json()["off_policy_manifest"]
    prompt_ids = c.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": True}).json()["tokens"]
    answer = c.post("/v1/chat/completions", json={"model": "tutor-adapter", "messages": MSGS, "temperature": 0,
                                                  "max_tokens": 16}).json()["choices"][0]["message"]["content"]
    answer_ids = c.post("/tokenize", json={"prompt": answer, "add_special_tokens": False}).json()["tokens"]
    rows = [_scored_row(c, prompt_ids, answer_ids, 8)]
    for seed in (1, 2):  # two sampled teacher answers as well
        r = c.post("/v1/completions", json={"model": "tutor-adapter", "prompt": prompt_ids, "max_tokens": 12,
                                            "temperature": 1.0, "seed": seed})
        sample = c.post("/tokenize", json={"prompt": r.json()["choices"][0]["text"],
                                           "add_special_tokens": False}).json()["tokens"]
        if sample:
            rows.append(_scored_row(c, prompt_ids, sample, 8))

    def write(name: str, header_manifest: dict, body: list[dict], count: int | None = None) -> str:
        path = home / "data" / "opd" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"schema": "kiln.opd-off-policy-teacher.v1", "manifest": header_manifest,
                  "rows": len(body) if count is None else count}
        path.write_text("\n".join(json.dumps(x) for x in [header, *body]) + "\n")
        return f"opd/{name}"

    base = {"adapter": "student-off", "teacher": "tutor", "training_mode": "off_policy", "top_k": 8,
            "steps": 40, "learning_rate": 3e-3, "batch_size": 3, "auto_load": True,
            "locality": {"override": True}}  # held back by the locality guard otherwise (docs/training.md, "Locality")
    # refusals, each before queueing
    wrong = dict(manifest, teacher_fingerprint=manifest["teacher_fingerprint"][:-4] + "0000")
    r = c.post("/v1/train/opd", json=base | {"teacher_jsonl": write("wrong.jsonl", wrong, rows)})
    assert r.status_code == 409 and r.json()["error"]["code"] == "off_policy_binding_mismatch", r.text
    assert r.json()["error"]["param"] == "teacher_jsonl.manifest.teacher_fingerprint"
    r = c.post("/v1/train/opd", json=base | {"teacher_jsonl": write("short.jsonl", manifest, rows, len(rows) + 1)})
    assert r.status_code == 400 and "rows=" in r.json()["error"]["message"], r.text
    bad = [dict(rows[0], token_ids=rows[0]["token_ids"][:-1] + [10**6])]
    r = c.post("/v1/train/opd", json=base | {"teacher_jsonl": write("bad.jsonl", manifest, bad)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "teacher_jsonl", r.text
    import subprocess

    from tests.serving.conftest import KILN

    cli = subprocess.run([str(KILN), "train", "opd", "--url", srv.base_url, "-a", "student-off",
                          "-t", "tutor", "--teacher-jsonl", "opd/wrong.jsonl"], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode != 0 and "409 off_policy_binding_mismatch" in cli.stdout + cli.stderr, cli
    assert c.post("/v1/train/opd", json=base | {"teacher_jsonl": "../escape.jsonl"}).status_code == 400
    assert c.post("/v1/train/opd", json=base | {"teacher_jsonl": "opd/missing.jsonl"}).status_code == 404
    assert c.post("/v1/train/opd", json=base | {"teacher_jsonl": "opd/x", "prompts": [{"messages": MSGS}]}
                  ).status_code == 400
    assert c.post("/v1/train/opd", json=base | {"teacher_jsonl": "opd/x", "loss": "sampled_token"}).status_code == 400

    before = _answer_logprob(c, srv.model_id, prompt_ids, answer_ids)
    teacher_lp = _answer_logprob(c, "tutor-adapter", prompt_ids, answer_ids)
    r = c.post("/v1/train/opd", json=base | {"teacher_jsonl": write("good.jsonl", manifest, rows)})
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], timeout=600)
    assert job["state"] == "succeeded", job.get("error")
    rep = job["result"]["report"]
    assert rep["steps"] == 40 and rep["training_mode"] == "off_policy" and "teacher_s" not in rep
    info = str(c.get("/v1/adapters/student-off").json())  # the manifest binds the corpus
    assert "teacher_jsonl_sha256" in info and manifest["teacher_fingerprint"] in info
    # its receipt names the pinned kiln-teacher-v1 fingerprint and the corpus digest (docs/adapters.md)
    revdir = home / "adapters" / "student-off" / "revisions" / job["result"]["revision"]
    receipt = json.loads((revdir / "kiln-receipt.json").read_text())
    assert receipt["teacher"]["fingerprint"] == manifest["teacher_fingerprint"] and receipt["adapter"]["kind"] == "opd"
    assert receipt["inputs"]["teacher_jsonl_sha256"] == c.get("/v1/adapters/student-off").json()["manifest"][
        "config"]["teacher_jsonl_sha256"]
    after = _answer_logprob(c, "student-off", prompt_ids, answer_ids)
    assert after > before + 0.3 * (teacher_lp - before), (before, after, teacher_lp, rep)
