"""The training loops on the real built-in model: masks, resume equality, GRPO skips, cancel."""

from __future__ import annotations

import pytest
import torch

from kiln.training.core.checkpoints import latest_checkpoint, list_checkpoints
from kiln.training.core.data import TrainingDataError, tokenize_grpo_group, tokenize_sft
from kiln.training.schemas import GRPOGroup, SFTExample
from kiln.training.core.errors import JobCancelled, TrainingFailed
from kiln.training.core.loop import Hooks, Plan
from kiln.training.core.lora import add_private_adapter, adapter_state, lora_config
from kiln.training.grpo.job import run_grpo
from kiln.training.grpo.step import GRPOSettings, grpo_items
from kiln.training.sft.job import run_sft

EXAMPLES = [
    SFTExample.model_validate({"messages": [
        {"role": "user", "content": f"What is the colour of thing {i}?"},
        {"role": "assistant", "content": f"Thing {i} is {c}."},
    ]})
    for i, c in enumerate(["red", "green", "blue", "teal", "amber"])
]


@pytest.fixture()
def loaded(builtin_model_dir):
    from peft import get_peft_model

    from kiln.runtime.loader import load_model

    lm = load_model(builtin_model_dir, device="cpu")
    # An idle adapter stands in for whatever the engine has loaded; training must not disturb it.
    peft_model = get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle")
    return peft_model, lm.tokenizer


def test_assistant_mask_covers_exactly_the_assistant_reply(loaded):
    _, tok = loaded
    (row,) = tokenize_sft(tok, EXAMPLES[:1], max_seq_len=512)
    masked = [t for t, m in zip(row.input_ids, row.loss_mask) if m]
    assert tok.decode(masked) == "Thing 0 is red.<|im_end|>"
    assert len(row.input_ids) == len(row.loss_mask) and row.loss_mask[0] == 0


def test_too_long_example_is_rejected(loaded):
    _, tok = loaded
    with pytest.raises(TrainingDataError, match="max_seq_len"):
        tokenize_sft(tok, EXAMPLES[:1], max_seq_len=8)


def test_grpo_completion_mask(loaded):
    _, tok = loaded
    group = GRPOGroup.model_validate({"messages": [{"role": "user", "content": "Say hi"}],
                                      "completions": [{"text": "hi", "reward": 1}, {"text": "no", "reward": 0}]})
    rows = tokenize_grpo_group(tok, group, max_seq_len=128)
    masked = [t for t, m in zip(rows[0].input_ids, rows[0].loss_mask) if m]
    assert tok.decode(masked) == "hi<|im_end|>"


def test_right_padding_without_mask_matches_unpadded_rows(loaded):
    from kiln.training.core.data import collate
    from kiln.training.grpo.step import _sequence_logprobs

    peft_model, tok = loaded
    rows = tokenize_sft(tok, EXAMPLES[:1] + [SFTExample.model_validate({"messages": [
        {"role": "user", "content": "A much longer question so that the first row gets padded?"},
        {"role": "assistant", "content": "Yes."}]})], max_seq_len=512)
    with torch.no_grad():
        both = _sequence_logprobs(peft_model, collate(rows, tok.pad_token_id))
        alone = _sequence_logprobs(peft_model, collate(rows[:1], tok.pad_token_id))
    n = len(rows[0].input_ids) - 1
    assert both.shape[1] > n
    torch.testing.assert_close(both[0, :n], alone[0], rtol=0, atol=1e-5)


def _train(peft_model, tok, *, name, hooks=None, resume=None, plan=None):
    rows = tokenize_sft(tok, EXAMPLES, max_seq_len=512)
    plan = plan or Plan(learning_rate=5e-3, epochs=3, batch_size=2, seed=7, checkpoint_interval=2)
    if resume is None:
        add_private_adapter(peft_model, name, lora_config(4, 8, ["q_proj", "v_proj"]), seed=plan.seed)
    return run_sft(peft_model, name, rows, plan, pad_id=tok.pad_token_id, hooks=hooks, resume=resume)


def test_interrupted_then_resumed_equals_uninterrupted(loaded, tmp_path):
    peft_model, tok = loaded
    idle_before = {k: v.clone() for k, v in adapter_state(peft_model, "idle").items()}
    full = _train(peft_model, tok, name="run1")
    assert full.steps == 9  # 3 epochs x ceil(5 / 2)
    reference = {k: v.clone() for k, v in adapter_state(peft_model, "run1").items()}

    # Interrupt after step 5 (mid-epoch): the checkpoint at step 4 is the newest.
    calls = {"n": 0}

    def stop_after_five() -> bool:
        calls["n"] += 1
        return calls["n"] > 5

    root = tmp_path / "ckpt"
    with pytest.raises(JobCancelled) as info:
        _train(peft_model, tok, name="run2", hooks=Hooks(should_cancel=stop_after_five, checkpoint_root=root,
                                                         plan_sha256="p"))
    assert info.value.step == 5
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004"]
    peft_model.delete_adapter("run2")

    ckpt = latest_checkpoint(root, plan_sha256="p")
    assert (ckpt.step, ckpt.epoch, ckpt.batch) == (4, 1, 1)
    add_private_adapter(peft_model, "run3", lora_config(4, 8, ["q_proj", "v_proj"]), seed=999)  # different init
    resumed = _train(peft_model, tok, name="run3", resume=ckpt, hooks=Hooks(checkpoint_root=root, plan_sha256="p"))
    assert resumed.steps == 9
    final = adapter_state(peft_model, "run3")
    assert final.keys() == reference.keys()
    for k in reference:
        assert torch.equal(final[k], reference[k]), k
    # The engine's own adapter was never touched by training.
    for k, v in adapter_state(peft_model, "idle").items():
        assert torch.equal(v, idle_before[k])
    assert peft_model.active_adapter == "idle"


def test_checkpoint_for_another_plan_is_refused(loaded, tmp_path):
    from kiln.training.core.checkpoints import CheckpointError

    peft_model, tok = loaded
    _train(peft_model, tok, name="run1", hooks=Hooks(checkpoint_root=tmp_path, plan_sha256="one"))
    with pytest.raises(CheckpointError, match="different training plan"):
        latest_checkpoint(tmp_path, plan_sha256="two")


def test_grpo_skips_zero_variance_groups_and_moves_toward_reward(loaded):
    peft_model, tok = loaded
    groups = [
        GRPOGroup.model_validate({"messages": [{"role": "user", "content": "Pick a colour"}],
                                  "completions": [{"text": "blue", "reward": 1.0}, {"text": "red", "reward": 0.0}]}),
        GRPOGroup.model_validate({"messages": [{"role": "user", "content": "Say yes"}],
                                  "completions": [{"text": "yes", "reward": 0.5}, {"text": "no", "reward": 0.5}]}),
    ]
    rows = [tokenize_grpo_group(tok, g, max_seq_len=128) for g in groups]
    items, skipped = grpo_items(rows, [[c.reward for c in g.completions] for g in groups], scale_rewards=True)
    assert skipped == 1 and len(items) == 1
    add_private_adapter(peft_model, "g", lora_config(8, 16, ["q_proj", "v_proj"]), seed=0)

    def seq_logp(row):
        from kiln.training.core.data import collate
        from kiln.training.losses.sft import shifted_token_logprobs
        b = collate([row], tok.pad_token_id)
        with torch.no_grad():
            lp = shifted_token_logprobs(peft_model(input_ids=b["input_ids"]).logits, b["input_ids"])
        return float((lp * b["loss_mask"][:, 1:]).sum())

    peft_model.set_adapter("g")
    before = seq_logp(items[0].rows[0]) - seq_logp(items[0].rows[1])
    report = run_grpo(peft_model, "g", items, Plan(1e-3, 10, 4, 0), GRPOSettings(kl_coef=0.05, kl_estimator="k3"),
                      pad_id=tok.pad_token_id, skipped_groups=skipped)
    peft_model.set_adapter("g")
    after = seq_logp(items[0].rows[0]) - seq_logp(items[0].rows[1])
    # The rewarded completion became relatively more likely, by a margin far above float noise
    # (measured 2.73 nats on 1 thread, 2 threads and ATEN_CPU_CAPABILITY=default).
    assert after - before > 1.0, after - before
    d = report.as_dict()
    assert d["skipped_zero_variance_groups"] == 1 and d["groups"] == 2 and d["steps"] == 10
    assert d["kl"] > 0


def test_grpo_with_only_zero_variance_groups_fails_clearly(loaded):
    peft_model, tok = loaded
    add_private_adapter(peft_model, "z", lora_config(2, 4, ["q_proj"]), seed=0)
    with pytest.raises(TrainingFailed, match="equal rewards"):
        run_grpo(peft_model, "z", [], Plan(1e-3, 1, 1, 0), GRPOSettings(), pad_id=0, skipped_groups=3)
