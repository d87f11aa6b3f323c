"""Packing a batch's rows into fewer sequences computes what the unpadded rows compute, and the step
options (packing, gradient checkpointing) keep exact resume and refuse a resume that changes them."""

from __future__ import annotations

import pytest
import torch

from kiln.training.core.checkpoints import latest_checkpoint
from kiln.training.core.data import Row, collate, collate_packed, pack_bins, tokenize_sft
from kiln.training.core.errors import JobCancelled, TrainingFailed
from kiln.training.core.loop import Hooks, Plan
from kiln.training.core.lora import adapter_state, add_private_adapter, lora_config
from kiln.training.losses.chunked import split_causal_lm
from kiln.training.schemas import SFTExample
from kiln.training.sft.job import run_sft

# Lengths differ a lot, as in real chat data: short corrections next to one long answer.
EXAMPLES = [
    SFTExample.model_validate({"messages": [
        {"role": "user", "content": q},
        {"role": "assistant", "content": a},
    ]})
    for q, a in [
        ("Hi?", "Hello."),
        ("What is the capital of France?", "Paris."),
        ("Tell me a long story about a fox, a crow, a piece of cheese and flattery.",
         ("A crow sat on a branch with a piece of cheese. A fox came by and praised her voice, "
          "asking her to sing. She opened her beak to sing, the cheese fell, and the fox ate it.")),
        ("2+2?", "4."),
        ("Name a colour.", "Teal."),
    ]
]


@pytest.fixture()
def model_and_rows(builtin_model_dir):
    from peft import get_peft_model

    from kiln.runtime.loader import load_model

    lm = load_model(builtin_model_dir, device="cpu")
    torch.manual_seed(0)
    peft_model = get_peft_model(lm.model, lora_config(4, 8, ["q_proj", "v_proj"]), adapter_name="idle")
    with torch.no_grad():  # non-zero LoRA B, so the adapter takes part in every compared value
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    rows = tokenize_sft(lm.tokenizer, EXAMPLES, max_seq_len=512)
    return peft_model, rows, lm.tokenizer.pad_token_id


def test_pack_bins_keeps_every_row_once_within_the_longest():
    lengths = [5, 40, 12, 30, 9, 40, 1]
    bins = pack_bins(lengths)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= max(lengths) for b in bins)
    assert len(bins) == 4 and bins == pack_bins(lengths)  # [40], [40], [30, 9, 1], [12, 5]; deterministic
    assert pack_bins([7, 7, 7]) == [[0], [1], [2]]


def _row_losses(split, batch, rows_of_positions):
    """Per row: mean CE over its supervised tokens, from one forward of ``batch``."""
    hidden = split.hidden(batch["input_ids"], position_ids=batch.get("position_ids"))
    logits = (hidden @ split.head.weight.t()).float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return [-(logp[b, cols]).mean() for b, cols in rows_of_positions]


def test_packed_batch_equals_each_row_alone(model_and_rows):
    peft_model, rows, pad = model_and_rows
    split = split_causal_lm(peft_model)
    assert split is not None
    packed = collate_packed(rows, pad)
    assert packed["input_ids"].shape[0] < len(rows)  # the batch really was packed
    assert int(packed["attention_mask"].sum()) == sum(len(r.input_ids) for r in rows)

    # Where each row's supervised positions landed in the packed batch.
    bins = pack_bins([len(r.input_ids) for r in rows])
    where: dict[int, tuple[int, torch.Tensor]] = {}
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            cols = torch.tensor([at + c for c, m in enumerate(rows[i].loss_mask[1:]) if m])
            where[i] = (b, cols)
            at += len(rows[i].input_ids)
    with torch.no_grad():
        packed_losses = _row_losses(split, packed, [where[i] for i in range(len(rows))])
        for i, row in enumerate(rows):
            alone = collate([row], pad)
            cols = torch.tensor([c for c, m in enumerate(row.loss_mask[1:]) if m])
            (single,) = _row_losses(split, alone, [(0, cols)])
            assert packed_losses[i].item() == pytest.approx(single.item(), rel=1e-5, abs=1e-6), i


def _sft_loss_and_grads(peft_model, batch):
    from kiln.training.losses.chunked import sft_loss_from_hidden

    split = split_causal_lm(peft_model)
    peft_model.zero_grad(set_to_none=True)
    loss = sft_loss_from_hidden(split.hidden(batch["input_ids"], position_ids=batch.get("position_ids")),
                                split.head.weight, batch["input_ids"], batch["loss_mask"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}
    peft_model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_packed_loss_and_gradients_equal_padded(model_and_rows):
    peft_model, rows, pad = model_and_rows
    loss_padded, g_padded = _sft_loss_and_grads(peft_model, collate(rows, pad))
    loss_packed, g_packed = _sft_loss_and_grads(peft_model, collate_packed(rows, pad))
    assert loss_packed == pytest.approx(loss_padded, rel=1e-5)
    assert g_padded.keys() == g_packed.keys() and g_padded
    for n in g_padded:
        torch.testing.assert_close(g_packed[n], g_padded[n], rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(model_and_rows):
    from kiln.training.core.step import TrunkRunner

    peft_model, rows, pad = model_and_rows
    batch = collate_packed(rows, pad)
    loss_plain, g_plain = _sft_loss_and_grads(peft_model, batch)
    runner = TrunkRunner(peft_model, split_causal_lm(peft_model), gradient_checkpointing=True, compile=False)
    assert len(runner.layers) == 2
    with runner.training():
        assert all("forward" in layer.__dict__ for layer in runner.layers)
        loss_ckpt, g_ckpt = _sft_loss_and_grads(peft_model, batch)
    assert not any("forward" in layer.__dict__ for layer in runner.layers)  # serving sees the plain layers
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    for n in g_plain:
        torch.testing.assert_close(g_ckpt[n], g_plain[n], rtol=1e-5, atol=1e-6)


def _train(peft_model, rows, pad, name, plan, *, hooks=None, resume=None):
    if resume is None:
        add_private_adapter(peft_model, name, lora_config(4, 8, ["q_proj", "v_proj"]), seed=plan.seed)
    return run_sft(peft_model, name, rows, plan, pad_id=pad, hooks=hooks, resume=resume)


def test_packed_checkpointed_resume_equals_uninterrupted_and_refuses_changed_options(model_and_rows, tmp_path):
    peft_model, rows, pad = model_and_rows
    rows = rows * 2  # 10 rows, batch 4: 3 batches per epoch, the last one short
    plan = Plan(learning_rate=5e-3, epochs=2, batch_size=4, seed=3, checkpoint_interval=2, packing=True,
                gradient_checkpointing=True)
    full = _train(peft_model, rows, pad, "full", plan)
    assert full.steps == 6 and full.extra["padded_positions_saved"] > 0
    reference = {k: v.clone() for k, v in adapter_state(peft_model, "full").items()}

    calls = {"n": 0}

    def stop_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    root = tmp_path / "ckpt"
    with pytest.raises(JobCancelled):
        _train(peft_model, rows, pad, "cut", plan, hooks=Hooks(should_cancel=stop_after_three, checkpoint_root=root,
                                                                plan_sha256="p"))
    ckpt = latest_checkpoint(root, plan_sha256="p")
    assert ckpt.step == 2

    for changed in ({"gradient_checkpointing": False}, {"packing": False}):
        other = Plan(**{**plan.__dict__, **changed})
        add_private_adapter(peft_model, "wrong", lora_config(4, 8, ["q_proj", "v_proj"]), seed=1)
        with pytest.raises(TrainingFailed, match=f"{next(iter(changed))}=True -> False"):
            _train(peft_model, rows, pad, "wrong", other, resume=ckpt)
        peft_model.delete_adapter("wrong")

    add_private_adapter(peft_model, "resumed", lora_config(4, 8, ["q_proj", "v_proj"]), seed=99)
    resumed = _train(peft_model, rows, pad, "resumed", plan, resume=ckpt)
    assert resumed.steps == 6
    assert resumed.extra["padded_positions_saved"] == full.extra["padded_positions_saved"]
    final = adapter_state(peft_model, "resumed")
    for k, v in reference.items():
        assert torch.equal(final[k], v), k


def test_packed_training_follows_the_padded_trajectory(model_and_rows):
    peft_model, rows, pad = model_and_rows
    plain = _train(peft_model, rows, pad, "padded", Plan(5e-3, 2, 5, 0))
    packed = _train(peft_model, rows, pad, "packed", Plan(5e-3, 2, 5, 0, packing=True))
    assert packed.final_loss == pytest.approx(plain.final_loss, rel=1e-4)
    a, b = adapter_state(peft_model, "padded"), adapter_state(peft_model, "packed")
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=1e-3, atol=1e-5)


def test_rows_without_savings_are_not_packed():
    rows = [Row([1, 2, 3], [0, 1, 1]), Row([4, 5, 6], [0, 0, 1])]
    assert "position_ids" not in collate_packed(rows, 0)


@pytest.mark.slow
def test_compiled_trunk_follows_the_eager_trajectory(model_and_rows):
    """``training.compile``: the compiled trunk (bucket-padded batches) trains like the eager one."""
    peft_model, rows, pad = model_and_rows
    eager = _train(peft_model, rows, pad, "eager", Plan(5e-3, 2, 5, 0, packing=True))
    compiled = _train(peft_model, rows, pad, "compiled", Plan(5e-3, 2, 5, 0, packing=True, compile=True))
    assert compiled.final_loss == pytest.approx(eager.final_loss, rel=1e-4)
    a, b = adapter_state(peft_model, "eager"), adapter_state(peft_model, "compiled")
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=1e-3, atol=1e-5)
