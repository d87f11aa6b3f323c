"""Multi-turn OpenEnv episodes as GRPO training data: every action is a row whose prompt is the conversation
before it, and every row of an episode carries that episode's group-normalised advantage."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from kiln.openenv import episode as ep
from kiln.runtime.tokenization import Tokenization
from kiln.training.grpo.rollouts import multi_turn_items
from kiln.training.losses.grpo import group_advantages
from kiln.training.schemas import GRPORequest
from tests.openenv.test_episodes import _episode

SYSTEM = [{"role": "system", "content": "Guess the digit."}, {"role": "user", "content": '{"prompt":"go"}'}]


def _episode_completion(actions, observations, reward):
    e = ep.Episode(0, {"observation": {}}, termination=ep.MAX_STEPS, episode_return=reward)
    e.actions, e.observations = list(actions), list(observations)
    return ep.as_completion(e)


@pytest.fixture(scope="module")
def tok(builtin_model_dir):
    return AutoTokenizer.from_pretrained(builtin_model_dir)


def test_every_action_is_a_row_with_the_conversation_before_it(tok):
    episodes = [
        _episode_completion(['{"guess": 3}', '{"guess": 1}', '{"guess": 0}'], ['{"o":1}', '{"o":2}', '{"o":3}'], 2.5),
        _episode_completion(['{"guess": 9}'], [], -1.0),  # ended as invalid after one action: one row
        _episode_completion(['{"guess": 5}', '{"guess": 4}'], ['{"o":1}'], 1.0),
    ]
    assert "turns" not in episodes[1] and len(episodes[0]["turns"]) == 2
    req = GRPORequest.model_validate({"adapter": "a", "groups": [{"messages": SYSTEM, "completions": episodes}]})
    rewards = [[c.reward for c in g.completions] for g in req.groups]
    items, skipped = multi_turn_items(tok, req.groups, rewards, max_seq_len=1024, scale_rewards=True)
    assert skipped == 0 and len(items) == 1
    rows, adv = items[0].rows, items[0].advantages
    assert len(rows) == 3 + 1 + 2 and adv.shape == (6,)
    expected = group_advantages(torch.tensor([2.5, -1.0, 1.0], dtype=torch.float64), scale_by_std=True)
    assert torch.equal(adv, expected.repeat_interleave(torch.tensor([3, 1, 2])))
    # row k of the first episode: its prompt is exactly what the policy was given before action k (the
    # serving tokenizer's rendering of the conversation so far), its completion is action k + eos
    serving = Tokenization(tok)
    history = list(SYSTEM)
    actions, observations = ['{"guess": 3}', '{"guess": 1}', '{"guess": 0}'], ['{"o":1}', '{"o":2}']
    for k, row in enumerate(rows[:3]):
        prompt = serving.encode_chat(history)
        n = row.loss_mask.index(1)
        assert row.input_ids[:n] == prompt and n == len(prompt)
        assert row.input_ids[n:] == tok(actions[k], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert all(m == 1 for m in row.loss_mask[n:])
        if k < 2:
            history += [{"role": "assistant", "content": actions[k]}, {"role": "user", "content": observations[k]}]


def test_zero_variance_groups_are_dropped(tok):
    same = [_episode_completion(['{"guess": 1}', '{"guess": 2}'], ['{"o":1}'], 1.0)] * 2
    req = GRPORequest.model_validate({"adapter": "a", "groups": [{"messages": SYSTEM, "completions": same}]})
    items, skipped = multi_turn_items(tok, req.groups, [[1.0, 1.0]], max_seq_len=1024, scale_rewards=True)
    assert (items, skipped) == ([], 1)


def test_a_real_episode_keeps_every_action_and_observation(env_servers):
    guesses = iter(range(9))
    result, _ = _episode(env_servers["counter"], lambda m: f'{{"guess": {next(guesses)}}}', max_steps=3)
    assert result.termination == ep.MAX_STEPS and len(result.actions) == 3 and len(result.observations) == 3
    c = ep.as_completion(result)
    assert c["text"] == '{"guess": 0}' and [t["text"] for t in c["turns"]] == ['{"guess": 1}', '{"guess": 2}']
    assert [t["observation"] for t in c["turns"]] == result.observations[:2]
    assert c["reward"] == result.episode_return
