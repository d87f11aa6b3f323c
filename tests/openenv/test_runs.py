"""OpenEnv runs end to end over a real ``kiln serve`` (built-in model) and real openenv-core servers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import start_server

CONFIG = """
[openenv]
max_active_runs = 1
max_tracked_runs = 3
exchange_timeout_s = 10.0
capacity_wait_s = 10.0
"""
KILN = Path(sys.executable).with_name("kiln")
RISE_MARGIN = 0.25  # returns are sums over STEPS steps (measured rises: 0.20 -> 0.84, 0.08 -> 0.95 with ATEN default)
STEPS = 2


@pytest.fixture(scope="module")
def kiln(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("oehome")
    cfg = home / "kiln.toml"
    cfg.write_text(CONFIG)
    server = start_server(builtin_model_dir, home, extra_args=[], env_extra={}, config=cfg)
    try:
        yield server, home
    finally:
        server.proc.terminate()
        server.proc.wait(30)


def _body(url, adapter, **over):
    body = {"env_url": url, "instructions": "Guess the secret digit.", "group_size": 4, "groups": 3,
            "max_steps": 2, "seed": 0, "temperature": 1.0,
            "training": {"adapter": adapter, "learning_rate": 0.05, "epochs": 4, "lora_rank": 8}}
    body.update(over)
    return body


def _wait(base, run_id, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = httpx.get(f"{base}/v1/openenv/runs/{run_id}", timeout=10).json()
        if run["state"] in ("succeeded", "failed", "cancelled"):
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} did not finish: {run}")


def _runs_dir(home):
    return home / "adapters" / ".openenv" / "runs"


def test_preflight_refusals_spend_nothing(kiln, env_servers):
    server, home = kiln
    base = server.base_url
    before = sorted(_runs_dir(home).glob("*")) if _runs_dir(home).exists() else []
    cases = [
        ({"training": {"adapter": "x", "learning_rat": 0.1}}, "invalid_training_config"),  # a typo
        ({"training": {"adapter": "x", "lora_target_modules": ["nope"]}}, "unknown_target_modules"),  # needs the model
        ({"training": {"adapter": "x", "base_adapter": "missing"}}, "adapter_not_found"),
    ]
    for over, code in cases:
        r = httpx.post(f"{base}/v1/openenv/runs", json=_body(env_servers["guess"], "x", **over), timeout=30)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["code"] == code
    for over in ({"env_url": "http://10.1.2.3:80"}, {"training": {"adapter": "x", "groups": []}},
                 {"group_size": 1}):
        r = httpx.post(f"{base}/v1/openenv/runs", json=_body(env_servers["guess"], "x", **over), timeout=30)
        assert r.status_code == 400, r.text
    after = sorted(_runs_dir(home).glob("*")) if _runs_dir(home).exists() else []
    assert after == before
    assert httpx.get(f"{base}/v1/openenv/runs/oerun-0000000000000000", timeout=10).status_code == 404


def test_run_trains_an_adapter_and_the_return_rises(kiln, env_servers):
    """Multi-step episodes (the counter never ends them: Kiln's max_steps does, after 2 actions); GRPO trains on
    every action of every episode, each with the conversation before it, and the mean return rises."""
    server, home = kiln
    base = server.base_url
    # lr 0.02 x 8 epochs is far from local: the locality guard would hold the adapter back (that is tested in
    # tests/training/test_locality.py); here the run's mechanics are under test, so the operator overrides it
    train = {"adapter": "oe-guess", "learning_rate": 0.02, "epochs": 8, "lora_rank": 8, "auto_load": True,
             "locality": {"override": True}}
    body = _body(env_servers["counter"], "oe-guess", groups=4, group_size=8, max_steps=STEPS, training=train)
    r = httpx.post(f"{base}/v1/openenv/runs", json=body, timeout=60)
    assert r.status_code == 202, r.text
    run = _wait(base, r.json()["id"], timeout=300)
    assert run["state"] == "succeeded", run
    assert run["terminations"]["max_steps"] + run["terminations"]["invalid_model_action"] == 32
    assert run["terminations"]["max_steps"] >= 16 and run["terminations"]["done"] == 0
    assert run["progress"]["episodes_done"] == 32
    assert run["environment"]["discovery_sha256"] and run["training_contract"]["adapter"] == "oe-guess"
    assert run["training_job"]["state"] == "succeeded"
    on_disk = json.loads((_runs_dir(home) / run["id"] / "run.json").read_text())
    assert on_disk["state"] == "succeeded" and on_disk["training_job"]["id"] == run["training_job"]["id"]
    assert httpx.get(f"{base}/v1/adapters/oe-guess", timeout=10).status_code == 200
    rundir = _runs_dir(home) / run["id"]
    for name, entry in run["artifacts"].items():
        data = (rundir / name).read_bytes()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    rows = [json.loads(line) for line in (rundir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(g["completions"]) == 8 for g in rows)
    replay = json.loads((rundir / "replay.json").read_text())
    assert replay["rollouts_sha256"] == run["artifacts"]["rollouts.jsonl"]["sha256"]
    episodes = [e for g in replay["groups"] for e in g["episodes"]]
    # policy identity: the base model produced every action, recorded per action, for the run and in the receipt
    assert run["policy"] == replay["policy"] == {"adapter": None, "revision": None}
    assert all(e["policies"] == [run["policy"]] * len(e["actions"]) for e in episodes)
    completions = [c for g in rows for c in g["completions"]]
    # every action of every episode is in the training data (first action + turns), with its observation
    assert sum(1 + len(c.get("turns", [])) for c in completions) == run["progress"]["policy_actions"]
    for e, c in zip(episodes, completions):
        assert [c["text"]] + [t["text"] for t in c.get("turns", [])] == e["actions"] and c["reward"] == e["return"]
        if e["termination"] == "max_steps":
            assert len(e["actions"]) == STEPS and e["return"] == sum(x["result"]["reward"] for x in e["exchanges"])
    # the training receipt binds the published adapter revision, the GRPO config and the corpus
    receipt = json.loads((rundir / "train_receipt.json").read_text())
    result = run["training_job"]["result"]
    assert receipt["schema"] == "kiln.openenv-train-receipt.v1" and receipt["run_id"] == run["id"]
    assert receipt["adapter"]["revision"] == result["revision"] and receipt["adapter"]["name"] == "oe-guess"
    adapter_dir = Path(result["path"].replace("$KILN_ADAPTERS", str(home / "adapters")))  # paths are redacted
    manifest = (adapter_dir / "kiln-manifest.json").read_bytes()
    assert receipt["adapter"]["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
    assert receipt["artifacts"] == {k: run["artifacts"][k]["sha256"] for k in ("replay.json", "rollouts.jsonl")}
    assert receipt["discovery_sha256"] == run["environment"]["discovery_sha256"]
    assert len(receipt["training_contract_sha256"]) == 64 and receipt["policy"] == run["policy"]
    # the trained adapter as the behaviour policy on the same seeds, through `kiln openenv train`
    (home / "again.json").write_text(json.dumps({"epochs": 1}))
    cli = subprocess.run([str(KILN), "openenv", "train", env_servers["counter"], "--adapter", "oe-guess-2",
                          "--instructions", "Guess the secret digit.", "--groups", "4", "--group-size", "8",
                          "--max-steps", str(STEPS), "--policy-adapter", "oe-guess", "--training",
                          str(home / "again.json"), "--url", base],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "GRPO config" in cli.stdout and "published oe-guess-2 revision" in cli.stdout, cli.stdout
    assert f"policy: oe-guess@{result['revision'][:16]}" in cli.stdout, cli.stdout
    after = httpx.get(f"{base}/v1/openenv/runs", timeout=10).json()["data"][-1]
    assert after["request"]["policy_adapter"] == "oe-guess" and after["state"] == "succeeded"
    assert after["policy"] == {"adapter": "oe-guess", "revision": result["revision"]}
    print("OPENENV_RETURNS before", run["returns"]["mean"], "after", after["returns"]["mean"])
    assert after["progress"]["episodes_done"] == 32
    assert after["returns"]["mean"] > run["returns"]["mean"] + RISE_MARGIN, (run["returns"], after["returns"])
    # the CLI reads the same state
    out = subprocess.run([str(KILN), "openenv", "status", "--url", base], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0 and run["id"] in out.stdout
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert _metric(metrics, 'kiln_openenv_episodes_total{termination="max_steps"}') >= 32
    assert _metric(metrics, "kiln_openenv_episode_return_count") >= 64
    assert _metric(metrics, 'kiln_openenv_runs_finished_total{state="succeeded"}') >= 2
    assert _metric(metrics, "kiln_openenv_policy_actions_total") >= 64
    # artifact download: verified against the manifest while staging, published atomically
    for name in run["artifacts"]:
        dest = home / f"dl-{name}"
        got = subprocess.run([str(KILN), "openenv", "artifact", run["id"], name, "--out", str(dest), "--url", base],
                             capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        assert dest.read_bytes() == (rundir / name).read_bytes()
    missing = httpx.get(f"{base}/v1/openenv/runs/{run['id']}/artifacts/run.json", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "artifact_not_found"
    # disk drift after publication: the route refuses (409) and the CLI leaves nothing at --out
    replay_path = rundir / "replay.json"
    replay_path.write_bytes(replay_path.read_bytes().replace(b'"schema"', b'"schemX"'))
    drift = httpx.get(f"{base}/v1/openenv/runs/{run['id']}/artifacts/replay.json", timeout=10)
    assert drift.status_code == 409 and drift.json()["error"]["code"] == "artifact_integrity_failed"
    bad = subprocess.run([str(KILN), "openenv", "artifact", run["id"], "replay.json", "--out",
                          str(home / "drift.json"), "--url", base], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "artifact_integrity_failed" in bad.stderr
    assert not (home / "drift.json").exists() and not list(home.glob(".drift.json.*"))


def _metric(text, name):
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} not in /metrics"
    return values[0]


def test_preflight_inspects_and_persists_nothing(kiln, env_servers):
    server, home = kiln
    base = server.base_url
    before = sorted(_runs_dir(home).glob("*")) if _runs_dir(home).exists() else []
    body = _body(env_servers["guess"], "oe-pre", groups=5)
    r = httpx.post(f"{base}/v1/openenv/preflight", json=body, timeout=60)
    assert r.status_code == 200, r.text
    pre = r.json()
    assert pre["training_contract"]["adapter"] == "oe-pre" and pre["training_contract"]["epochs"] == 4
    assert "groups" not in pre["training_contract"] and len(pre["training_contract_sha256"]) == 64
    assert pre["environment"]["action_schema"]["required"] == ["guess"]
    assert pre["capacity"]["capacity_reserved"] is False
    again = httpx.post(f"{base}/v1/openenv/preflight", json=body, timeout=60).json()
    assert again["environment"]["discovery_sha256"] == pre["environment"]["discovery_sha256"]
    assert again["training_contract_sha256"] == pre["training_contract_sha256"]
    typo = httpx.post(f"{base}/v1/openenv/preflight", json=_body(env_servers["guess"], "x", training={
        "adapter": "x", "learning_rat": 1}), timeout=60)
    assert typo.status_code == 400 and typo.json()["error"]["code"] == "invalid_training_config"
    down = httpx.post(f"{base}/v1/openenv/preflight", json=_body("http://127.0.0.1:9", "x"), timeout=60)
    assert down.status_code == 503 and down.json()["error"]["code"] == "environment_unavailable"
    after = sorted(_runs_dir(home).glob("*")) if _runs_dir(home).exists() else []
    assert after == before


def test_hostile_oversized_observation_fails_without_artifacts(kiln, env_servers):
    server, _ = kiln
    base = server.base_url
    body = _body(env_servers["huge"], "oe-huge", idempotency_key="huge-1")
    r = httpx.post(f"{base}/v1/openenv/runs", json=body, timeout=60)
    assert r.status_code == 202
    retry = httpx.post(f"{base}/v1/openenv/runs", json=body, timeout=60)  # same key, same request: the same run
    assert retry.status_code == 202 and retry.json()["id"] == r.json()["id"]
    changed = httpx.post(f"{base}/v1/openenv/runs", json={**body, "groups": 2}, timeout=60)
    assert changed.status_code == 409 and changed.json()["error"]["code"] == "idempotency_key_reused"
    run = _wait(base, r.json()["id"])
    assert run["state"] == "failed" and run["error"]["code"] == "environment_frame_too_large"
    assert run["training_job"] is None and run["artifacts"] is None
    assert sorted(p.name for p in (_runs_dir(kiln[1]) / run["id"]).iterdir()) == ["run.json"]
    assert httpx.get(f"{base}/v1/adapters/oe-huge", timeout=10).status_code == 404


def test_identity_change_publishes_nothing(kiln, env_servers):
    server, _ = kiln
    base = server.base_url
    r = httpx.post(f"{base}/v1/openenv/runs", json=_body(env_servers["drift"], "oe-drift", groups=1), timeout=60)
    run = _wait(base, r.json()["id"])
    assert run["state"] == "failed" and run["error"]["code"] == "environment_identity_changed", run
    assert run["training_job"] is None and run["artifacts"] is None and run["progress"]["episodes_done"] == 4
    assert httpx.get(f"{base}/v1/adapters/oe-drift", timeout=10).status_code == 404


def test_unconstrained_invalid_actions_and_zero_variance(kiln, env_servers):
    server, _ = kiln
    base = server.base_url
    body = _body(env_servers["guess"], "oe-invalid", groups=1, constrained=False, max_action_tokens=8)
    run = _wait(base, httpx.post(f"{base}/v1/openenv/runs", json=body, timeout=60).json()["id"])
    # the built-in model does not write this schema's JSON on its own: every action is refused before sending,
    # every return is the protocol-error reward, and GRPO refuses groups with nothing to learn
    if run["terminations"]["invalid_model_action"] == 4:
        assert run["state"] == "failed" and run["error"]["code"] == "zero_variance_groups", run
        assert run["returns"]["mean"] == -1.0
    else:
        assert run["terminations"]["invalid_model_action"] >= 1


def test_fifo_queue_position_cancel_and_bound(kiln, env_servers):
    server, _ = kiln
    base = server.base_url
    slow = _body(env_servers["counter"], "oe-fifo", groups=8, max_steps=10)
    ids = [httpx.post(f"{base}/v1/openenv/runs", json=slow, timeout=60).json()["id"] for _ in range(3)]
    r = httpx.post(f"{base}/v1/openenv/runs", json=slow, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "openenv_queue_full" and "retry-after" in r.headers
    runs = [httpx.get(f"{base}/v1/openenv/runs/{i}", timeout=10).json() for i in ids]
    assert [x["admission_seq"] for x in runs] == sorted(x["admission_seq"] for x in runs)
    assert runs[2]["queue_position"] == runs[1]["queue_position"] + 1
    third = httpx.post(f"{base}/v1/openenv/runs/{ids[2]}/cancel", timeout=10).json()
    assert third["state"] == "cancelled" and third["progress"]["episodes_done"] == 0
    assert httpx.post(f"{base}/v1/openenv/runs/{ids[2]}/cancel", timeout=10).status_code == 409
    for i in ids[:2]:
        httpx.post(f"{base}/v1/openenv/runs/{i}/cancel", timeout=10)
    ends = [_wait(base, i) for i in ids[:2]]
    assert {e["state"] for e in ends} == {"cancelled"}, [e["error"] for e in ends]


def _train(base, adapter, answer):
    body = {"adapter": adapter, "auto_load": True, "epochs": 1,
            "examples": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]}]}
    r = httpx.post(f"{base}/v1/train/sft", json=body, timeout=60)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/train/jobs/{r.json()['id']}", timeout=10).json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            assert job["state"] == "succeeded", job
            return job["result"]["revision"]
        time.sleep(0.1)
    raise AssertionError(f"job {r.json()['id']} did not finish")


def test_policy_revision_change_mid_run_fails_the_run(kiln, env_servers):
    """The policy adapter is retrained (auto_load swaps the served revision) while a run collects: the run
    fails with policy_revision_changed, keeps the revision its actions came from, and trains nothing."""
    server, home = kiln
    base = server.base_url
    first = _train(base, "oe-policy", "one")
    body = _body(env_servers["counter"], "oe-mixed", groups=64, group_size=4, max_steps=16, policy_adapter="oe-policy")
    r = httpx.post(f"{base}/v1/openenv/runs", json=body, timeout=60)
    assert r.status_code == 202, r.text
    run_id = r.json()["id"]
    deadline = time.monotonic() + 120
    while True:  # collecting with the first revision
        run = httpx.get(f"{base}/v1/openenv/runs/{run_id}", timeout=10).json()
        if run["progress"]["policy_actions"] >= 1 or run["state"] in ("succeeded", "failed", "cancelled"):
            break
        assert time.monotonic() < deadline, run
        time.sleep(0.05)
    assert run["state"] == "collecting" and run["policy"] == {"adapter": "oe-policy", "revision": first}, run
    second = _train(base, "oe-policy", "two")
    assert second != first
    run = _wait(base, run_id, timeout=120)
    assert run["state"] == "failed" and run["error"]["code"] == "policy_revision_changed", run
    assert first[:12] in run["error"]["message"] and second[:12] in run["error"]["message"]
    assert run["policy"] == {"adapter": "oe-policy", "revision": first}
    assert run["training_job"] is None and run["artifacts"] is None
    assert run["progress"]["episodes_done"] < 64 * 4
    assert not (_runs_dir(home) / run_id / "rollouts.jsonl").exists()
    on_disk = json.loads((_runs_dir(home) / run_id / "run.json").read_text())
    assert on_disk["policy"] == run["policy"] and on_disk["error"]["code"] == "policy_revision_changed"
    assert httpx.get(f"{base}/v1/adapters/oe-mixed", timeout=10).status_code == 404
