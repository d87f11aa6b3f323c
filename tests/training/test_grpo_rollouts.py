"""GRPO with rollouts through a real `kiln serve` on 127.0.0.1: Kiln samples groups with the policy it
trains, scores them (an eval scorer, a sandboxed reward file, a loopback HTTP endpoint), and updates.

The learning check is a verifiable toy task on the built-in model: reward 1 when the completion
contains the word "spider" (the model starts at roughly one completion in six; "answer", which the
other tests use as a reference, is about 1 in 256, too rare to learn from on every CPU path). Seeds are fixed,
but no exact text is asserted (sampling differs across CPU code paths); the assertion is a rise of
the mean reward by a clear margin between the first and the last iterations.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from kiln.demo import wait_job
from kiln.evals.sandbox import landlock_abi
from tests.serving.conftest import start_server, stop_server
from tests.training.job_control import cancel_after_checkpoint

QUESTIONS = ["What color is the sky?", "What is two plus two?", "How many legs does an ant have?",
             "Name a fruit."]
PROMPTS = [{"messages": [{"role": "user", "content": q}], "reference": "answer"} for q in QUESTIONS]
CONTAINS = {"type": "scorer", "scorer": {"type": "contains"}}
# The base model's 4-token samples at temperature 1 contain "spider" about one time in six (46 and 35 of 256 on
# the AVX-512 and default ATen paths), so every iteration starts with groups that have reward variance.
LEARN_WORD = "spider"
FAST = {"group_size": 4, "iterations": 1, "max_tokens": 4, "batch_size": 4}

REWARD_FILE = '''
def reward(messages, completion, reference):
    return 1.0 if "is" in completion.split() else 0.0
'''


@pytest.fixture(scope="module")
def srv(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("grpo-home")
    (home / "data").mkdir()
    (home / "data" / "reward.py").write_text(REWARD_FILE)
    (home / "outside.py").write_text(REWARD_FILE)
    s = start_server(builtin_model_dir, home, extra_args=[], env_extra={"KILN_EVAL_ALLOW_CODE_EXECUTION": "1"},
                     config=None)
    c = httpx.Client(base_url=s.base_url, timeout=120)
    yield c
    c.close()
    stop_server(s)


def _run(c: httpx.Client, body: dict) -> dict:
    r = c.post("/v1/train/grpo", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], timeout=120)
    assert job["state"] == "succeeded", job
    assert job["result"]["locality"]["probes"] > 0  # every kind measures its adapter's locality
    return job


def test_mean_reward_rises_on_a_verifiable_task(srv, reward_server):
    prompts = [{"messages": p["messages"], "reference": LEARN_WORD} for p in PROMPTS]
    body = {"adapter": "says-spider", "prompts": prompts, "reward": CONTAINS, "group_size": 8, "iterations": 8,
            "max_tokens": 4, "temperature": 1.0, "learning_rate": 2e-2, "batch_size": 4, "seed": 3,
            "anchor_weight": 0}  # the rise's mechanics at an aggressive lr; the defaults' locality: bench/locality.py
    job = _run(srv, body)
    report = job["result"]["report"]
    rewards = report["reward_per_iteration"]
    assert len(rewards) == 8 and len(report["zero_variance_fraction_per_iteration"]) == 8
    assert all(0.0 <= f <= 1.0 for f in report["zero_variance_fraction_per_iteration"])
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last >= first + 0.25, rewards  # a real rise, not noise
    assert report["behaviour_policy"]["adapter"] is None and "continuous batching" in report["behaviour_policy"]["sampler"]
    # the status shows the per-iteration reward too (the job's progress)
    assert job["progress"]["reward_per_iteration"] == rewards
    assert "zero_variance_fraction" in job["progress"]
    # continuing from the published adapter records it as the behaviour policy
    print("reward per iteration:", rewards, "zero-variance fractions:",
          report["zero_variance_fraction_per_iteration"], "train_seconds:", report["train_seconds"])
    again = _run(srv, {"adapter": "says-spider-2", "base_adapter": "says-spider", "prompts": PROMPTS,
                       "reward": {"type": "http", "url": f"{reward_server}/score"}, **FAST})
    bp = again["result"]["report"]["behaviour_policy"]
    assert bp["adapter"] == "says-spider" and bp["revision"] == job["result"]["revision"]


@pytest.mark.parametrize("patch,code", [
    ({"reward": {"type": "scorer", "scorer": {"type": "levenshtein"}}}, None),  # unknown scorer
    ({"prompts": [{"messages": [{"role": "user", "content": "hi"}]}]}, "missing_reference"),
    # a judge that is not served: 404, the model is unknown to this server now (as vLLM answers an unknown LoRA)
    ({"reward": {"type": "scorer", "scorer": {"type": "judge", "judge": {"adapter": "nope"}}}}, "judge_not_loaded"),
    ({"reward": {"type": "scorer", "scorer": {"type": "regex", "pattern": "(a"}}}, "invalid_regex"),
    ({"reward": {"type": "http", "url": "http://10.0.0.1:9/r"}}, "reward_url_not_loopback"),
    ({"reward": {"type": "http", "url": "http://localhost:9/r"}}, "reward_url_not_loopback"),
    ({"reward": {"type": "http", "url": "file:///etc/passwd"}}, "invalid_reward_url"),
    ({"reward": {"type": "python", "path": "../outside.py"}}, "dataset_outside_data_dir"),
    ({"reward": {"type": "python", "path": "/etc/passwd"}}, "dataset_outside_data_dir"),
    ({"reward": None}, None),  # prompts without a reward
    ({"groups": [{"messages": [{"role": "user", "content": "q"}],
                  "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 0}]}]}, None),  # both sources
    ({"max_tokens": 1024, "max_seq_len": 64}, "sequence_too_long"),
])
def test_refusals_before_queueing(srv, patch, code):
    before = srv.get("/v1/train/status").json()
    body = {"adapter": "refused", "prompts": PROMPTS, "reward": CONTAINS, **FAST} | patch
    if body.get("reward") is None:
        body.pop("reward")
    r = srv.post("/v1/train/grpo", json=body)
    assert r.status_code == (404 if code == "judge_not_loaded" else 400), r.text
    if code is not None:
        assert r.json()["error"]["code"] == code, r.text
    after = srv.get("/v1/train/status").json()
    assert len(after["queued"]) == len(before["queued"]) and after["recent"] == before["recent"]


def test_rollout_settings_refused_with_pre_scored_groups(srv):
    groups = [{"messages": [{"role": "user", "content": "q"}],
               "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 0}]}]
    r = srv.post("/v1/train/grpo", json={"adapter": "x", "groups": groups, "group_size": 4})
    assert r.status_code == 400, r.text


class _RewardHandler(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _RewardHandler.seen.append(body)
        if self.path == "/redirect":
            self.send_response(307)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            self.end_headers()
            return
        if self.path == "/huge":
            out = b'{"rewards": [' + b"0," * 600_000 + b"0]}"
        else:
            # Alternating rewards: every group (contiguous items) has variance whatever the policy samples,
            # so a job continuing from an adapter that already answers one way still has something to learn.
            out = json.dumps({"rewards": [float(i % 2) for i, _it in enumerate(body["items"])]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def reward_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _RewardHandler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_loopback_http_reward(srv, reward_server):
    _RewardHandler.seen.clear()
    job = _run(srv, {"adapter": "http-reward", "prompts": PROMPTS,
                     "reward": {"type": "http", "url": f"{reward_server}/score"}, **FAST, "iterations": 2})
    assert len(_RewardHandler.seen) == 2
    items = _RewardHandler.seen[0]["items"]
    assert len(items) == len(PROMPTS) * FAST["group_size"]
    assert items[0]["reference"] == "answer" and items[0]["messages"][0]["content"] == QUESTIONS[0]
    assert len(job["result"]["report"]["reward_per_iteration"]) == 2


@pytest.mark.parametrize("path,why", [("/redirect", "HTTP 307"), ("/huge", "more than")])
def test_http_reward_redirects_and_oversize_fail_the_job(srv, reward_server, path, why):
    r = srv.post("/v1/train/grpo", json={"adapter": "http-bad", "prompts": PROMPTS, **FAST, "reward": {
        "type": "http", "url": f"{reward_server}{path}", "max_response_bytes": 100_000}})
    assert r.status_code == 202, r.text
    job = wait_job(srv, r.json()["id"], timeout=120)
    assert job["state"] == "failed" and why in job["error"], job


@pytest.mark.skipif(landlock_abi() < 1, reason="the evals sandbox needs Landlock")
def test_sandboxed_reward_file(srv):
    job = _run(srv, {"adapter": "file-reward", "prompts": PROMPTS,
                     "reward": {"type": "python", "path": "reward.py", "timeout_s": 20}, **FAST})
    report = job["result"]["report"]
    assert len(report["reward_per_iteration"]) == 1 and 0.0 <= report["reward_per_iteration"][0] <= 1.0
    # the file's digest is bound to the published adapter's config
    manifest = srv.get("/v1/adapters/file-reward").json()
    assert "reward_source" in json.dumps(manifest)


def test_resume_equals_uninterrupted(srv, reward_server):
    """A rollout job cancelled after a checkpoint inside an iteration and resumed ends with the weights of the
    uninterrupted job (the checkpoint carries the iteration's groups; later iterations are seeded)."""
    body = {"prompts": PROMPTS, "reward": {"type": "http", "url": f"{reward_server}/score"}, "group_size": 4,
            "iterations": 6, "max_tokens": 4, "epochs": 2, "batch_size": 2, "learning_rate": 1e-2,
            "checkpoint_interval": 3, "auto_load": True,  # 4 steps per iteration: checkpoints fall inside them
            "locality": {"override": True}}  # resume is under test here, the guard in test_locality.py
    whole = _run(srv, body | {"adapter": "ro-whole"})
    assert whole["result"]["report"]["steps"] == 24
    job = srv.post("/v1/train/grpo", json=body | {"adapter": "ro-parted"}).json()
    cancel_after_checkpoint(srv, job["id"], 3, timeout=120)
    resumed = _run(srv, body | {"adapter": "ro-parted", "resume_from_job": job["id"]})
    assert resumed["result"]["resumed_from_step"] >= 3 and resumed["result"]["report"]["steps"] == 24
    report = resumed["result"]["report"]
    assert report["reward_per_iteration"] == whole["result"]["report"]["reward_per_iteration"]
    from tests.training.test_opd import _adapter_scores

    a, b = _adapter_scores(srv, "ro-whole"), _adapter_scores(srv, "ro-parted")
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    # a different request cannot resume it
    r = srv.post("/v1/train/grpo", json=body | {"adapter": "ro-parted", "seed": 9, "resume_from_job": job["id"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "resume_plan_mismatch"


def test_judge_reward(srv):
    """The eval judge as a reward: a judge adapter taught to answer PASS to the rubric scores the samples
    higher than the base model as judge (which does not write PASS)."""
    from kiln.evals.schemas import JudgeScorer
    from kiln.evals.scorers import judge_prompt

    rubric = JudgeScorer(type="judge")
    examples = [{"messages": [{"role": "user", "content": judge_prompt(rubric, q, "answer", a)},
                              {"role": "assistant", "content": "PASS"}]}
                for q in QUESTIONS for a in ("blue", "four", "six legs", "an apple", "answer", "spider")]
    _run_sft = srv.post("/v1/train/sft", json={"adapter": "judge-pass", "examples": examples, "auto_load": True})
    assert _run_sft.status_code == 202, _run_sft.text
    assert wait_job(srv, _run_sft.json()["id"], timeout=300)["state"] == "succeeded"
    means = {}
    for judge in (None, {"adapter": "judge-pass"}):
        scorer = {"type": "judge", **({"judge": judge} if judge else {})}
        r = srv.post("/v1/train/grpo", json={"adapter": f"judged-{bool(judge)}", "prompts": PROMPTS, **FAST,
                                             "reward": {"type": "scorer", "scorer": scorer}})
        assert r.status_code == 202, r.text
        job = wait_job(srv, r.json()["id"], timeout=120)
        # every sample judged PASS (or none) is a zero-variance job: it fails, its rewards are still reported
        assert job["state"] in ("succeeded", "failed"), job
        means[bool(judge)] = job["progress"]["reward_per_iteration"][0]
    assert means[True] > means[False] + 0.5, means


def test_cli_prompts_and_reward(srv, reward_server, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS))
    kiln = Path(sys.executable).with_name("kiln")
    base = str(srv.base_url).rstrip("/")
    reward = json.dumps({"type": "http", "url": f"{reward_server}/score"})
    out = subprocess.run([str(kiln), "train", "grpo", "--prompts", str(f), "--reward", reward, "--group-size", "4",
                          "--iterations", "2", "--max-tokens", "4", "--batch-size", "4", "--adapter", "cli-grpo",
                          "--url", base], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "published cli-grpo" in out.stdout
    job = next(j for j in srv.get("/v1/train/status").json()["recent"] if j["adapter"] == "cli-grpo")
    assert len(job["progress"]["reward_per_iteration"]) == 2
    both = subprocess.run([str(kiln), "train", "grpo", "--prompts", str(f), "--file", str(f), "--adapter", "x",
                           "--url", base], capture_output=True, text=True, timeout=60)
    assert both.returncode != 0 and "exactly one of --file" in both.stderr


def test_group_size_above_the_engine_queue_is_refused():
    """One prompt's group is queued together on the engine: a group larger than the queue is a 400."""
    from types import SimpleNamespace

    from kiln.errors import InvalidRequest
    from kiln.runtime.engine import EngineConfig
    from kiln.training.core.engine_sampling import check_samples_fit_queue

    engine = SimpleNamespace(config=EngineConfig(max_queued_rows=8))
    check_samples_fit_queue(engine, 8, "group_size")
    with pytest.raises(InvalidRequest) as err:
        check_samples_fit_queue(engine, 9, "group_size")
    assert err.value.code == "samples_exceed_queue" and err.value.param == "group_size"


@pytest.mark.slow  # 60 iterations of 4 prompts x 8 samples (~7 s at load 2, minutes on a loaded 2-core machine)
def test_the_defaults_learn_a_rewarded_word_and_keep_the_base_answers(srv):
    """Issue 48: GRPO with rollouts and nothing but prompts and a reward (the word "wheels", which the base never
    writes on these prompts) raises the reward and is served past the locality guard: the defaults' lr, iterations
    and KL-to-base anchor (kiln.training.schemas, DEFAULT_GRPO_ROLLOUT_*)."""
    from kiln.training.schemas import (
        DEFAULT_GRPO_ROLLOUT_ANCHOR_WEIGHT,
        DEFAULT_GRPO_ROLLOUT_ITERATIONS,
        DEFAULT_GRPO_ROLLOUT_LEARNING_RATE,
    )

    prompts = [{"messages": [{"role": "user", "content": p}], "reference": "wheels"}
               for p in ("Tell me about your day.", "What is on the road?", "What do you see outside?",
                         "Say something about travel.")]
    r = srv.post("/v1/train/grpo", json={"adapter": "wheels", "auto_load": True, "prompts": prompts, "reward": CONTAINS})
    assert r.status_code == 202, r.text
    job = wait_job(srv, r.json()["id"], timeout=900)
    assert job["state"] == "succeeded", job
    rewards = job["result"]["report"]["reward_per_iteration"]
    assert len(rewards) == DEFAULT_GRPO_ROLLOUT_ITERATIONS and sum(rewards[-3:]) / 3 >= 0.4, rewards
    config = srv.get("/v1/adapters/wheels").json()["manifest"]["config"]
    assert config["learning_rate"] == DEFAULT_GRPO_ROLLOUT_LEARNING_RATE
    assert config["anchor_weight"] == DEFAULT_GRPO_ROLLOUT_ANCHOR_WEIGHT > 0
    loc = job["result"]["locality"]
    assert job["result"]["activated"] is True and loc["degenerate"] == 0, loc
