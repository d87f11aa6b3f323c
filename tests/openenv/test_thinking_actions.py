"""OpenEnv actions on a reasoning template: the model thinks first, then the action grammar applies.

The scripted Qwen3 (:mod:`tests.scripted_model`, the real Qwen3 tokenizer and template) reasons "banana" and
closes its span when it is open; under the guess environment's action grammar the run opens the span after
the prompt, so the grammar starts after ``</think>`` and every action is a valid guess. The replay keeps each
action apart from its reasoning; the rollouts GRPO trains on carry the whole generation.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.openenv.test_runs import CONFIG, _wait
from tests.scripted_model import scripted_qwen3_dir
from tests.serving.conftest import start_server, stop_server


@pytest.fixture(scope="module")
def thinking_kiln(tmp_path_factory):
    home = tmp_path_factory.mktemp("oe-think")
    cfg = home / "kiln.toml"
    cfg.write_text(CONFIG)
    server = start_server(scripted_qwen3_dir(), home, extra_args=["--max-model-len", "2048"], env_extra={},
                          config=cfg)
    yield server
    stop_server(server)


def test_action_thinks_first_then_is_a_valid_action(thinking_kiln, env_servers):
    base = thinking_kiln.base_url
    body = {"env_url": env_servers["guess"], "instructions": "Guess the secret digit.", "group_size": 2,
            "groups": 1, "max_steps": 2, "seed": 0, "temperature": 1.0, "max_action_tokens": 24,
            "thinking_token_budget": 8, "training": {"adapter": "thinking-guesser", "epochs": 1, "lora_rank": 4}}
    r = httpx.post(f"{base}/v1/openenv/runs", json=body, timeout=30)
    assert r.status_code == 202, r.text
    run = _wait(base, r.json()["id"], timeout=300)
    assert run["state"] in ("succeeded", "failed"), run
    replay = json.loads(httpx.get(f"{base}/v1/openenv/runs/{run['id']}/artifacts/replay.json", timeout=30).content)
    episodes = [e for g in replay["groups"] for e in g["episodes"]]
    assert episodes and all(e["termination"] != "invalid_model_action" for e in episodes), episodes
    for e in episodes:
        assert e["actions"] and e["reasoning"] == ["banana"] * len(e["actions"])
        for action in e["actions"]:
            assert 0 <= json.loads(action)["guess"] <= 9 and "think>" not in action
    rollouts = httpx.get(f"{base}/v1/openenv/runs/{run['id']}/artifacts/rollouts.jsonl", timeout=30).text
    first = json.loads(rollouts.splitlines()[0])["completions"][0]["text"]
    assert first.startswith("<think>banana</think>") and first.endswith(episodes[0]["actions"][0])
