"""A step cut into pieces (row micro-batches, the anchor rows, the optimizer step: one exclusive hold each) computes
what the whole step computes: the same losses, gradients and trajectory, for SFT (padded and packed), GRPO, OPD and
KD. With a bounded hold each piece is also cut between its decoder layers (several holds per row,
:class:`kiln.training.core.segments.LayerHolds`); the gradients and trajectories stay those of the whole step."""

from __future__ import annotations

import pytest
import torch

from kiln.training.core.anchor import Anchor, AnchorRow, AnchorSettings
from kiln.training.core.data import Row, collate, tokenize_sft
from kiln.training.core.loop import Hooks, Plan, row_groups, sub_batch
from kiln.training.core.lora import adapter_state, add_private_adapter, lora_config
from kiln.training.grpo.job import run_grpo
from kiln.training.grpo.step import GRPOItem, GRPOSettings
from kiln.training.schemas import SFTExample
from kiln.training.sft.job import run_sft

EXAMPLES = [
    SFTExample.model_validate({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    for q, a in [
        ("Hi?", "Hello."),
        ("What is the capital of France?", "Paris."),
        ("Tell me a story about a fox and a crow.", "A crow held cheese; a fox praised her song and ate it."),
        ("2+2?", "4."),
        ("Name a colour.", "Teal."),
        ("Which bird guards the old mill?", "The old mill is guarded by a heron."),
    ]
]


class CountingHolds:
    """Hooks whose every exclusive hold is counted; ``budget`` is what the pacer would give (None: idle)."""

    def __init__(self, budget: float | None):
        self.budget, self.holds = budget, 0

    def hooks(self) -> Hooks:
        from contextlib import contextmanager

        @contextmanager
        def hold():
            self.holds += 1
            yield

        return Hooks(exclusive=hold, hold_budget=lambda: self.budget)


@pytest.fixture()
def model_and_rows(builtin_model_dir):
    from peft import get_peft_model

    from kiln.runtime.loader import load_model

    lm = load_model(builtin_model_dir, device="cpu")
    torch.manual_seed(0)
    peft_model = get_peft_model(lm.model, lora_config(4, 8, ["q_proj", "v_proj"]), adapter_name="idle")
    rows = tokenize_sft(lm.tokenizer, EXAMPLES, max_seq_len=512)
    return peft_model, rows, lm.tokenizer.pad_token_id


def _anchor(rows: list[Row], top_k: int = 4) -> Anchor:
    """An anchor of fabricated base rows (a valid sparse distribution at every answer token)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for r in rows:
        n = sum(r.loss_mask[1:])
        ids = torch.randint(0, 200, (n, top_k), generator=g)
        logp = torch.log(0.9 * torch.softmax(torch.randn(n, top_k, generator=g), -1))
        prompt = tuple(r.input_ids[:r.loss_mask.index(1)])
        out.append(AnchorRow(prompt, r, ids, logp, torch.ones(n, top_k, dtype=torch.bool), torch.full((n,), 0.1)))
    return Anchor(out, AnchorSettings(questions=len(out), per_step=2, weight=0.5))


def _sft(peft_model, rows, pad, name, plan, holds, anchor=None):
    add_private_adapter(peft_model, name, lora_config(4, 8, ["q_proj", "v_proj"]), seed=plan.seed)
    return run_sft(peft_model, name, rows, plan, pad_id=pad, hooks=holds.hooks(), anchor=anchor)


def _close(peft_model, a: str, b: str) -> None:
    sa, sb = adapter_state(peft_model, a), adapter_state(peft_model, b)
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        assert not torch.equal(v, adapter_state(peft_model, "idle").get(k, torch.zeros(0)))  # it trained
        torch.testing.assert_close(sb[k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packing", [False, True])
def test_sliced_sft_follows_the_whole_step_trajectory(model_and_rows, packing):
    peft_model, rows, pad = model_and_rows
    anchor = _anchor(rows[:3])
    plan = Plan(5e-3, 2, 6, 0, packing=packing)
    whole_holds, sliced_holds = CountingHolds(None), CountingHolds(1e-9)  # a tiny budget: one row per piece
    whole = _sft(peft_model, rows, pad, "whole", plan, whole_holds, anchor)
    sliced = _sft(peft_model, rows, pad, "sliced", plan, sliced_holds, anchor)
    assert whole.steps == sliced.steps == 2
    assert "sliced_steps" not in whole.extra and sliced.extra["sliced_steps"] == 2
    # whole: per step one hold for forward and backward (never cut: serving idles) and one for the optimizer step
    # (+1 to release); sliced: per row (or packed sequence), the anchor and the optimizer step, more between layers
    assert whole_holds.holds == 5 and sliced_holds.holds >= 2 * (2 + 2) + 1
    assert sliced.final_loss == pytest.approx(whole.final_loss, rel=1e-5)
    assert sliced.extra["anchor_kl"] == pytest.approx(whole.extra["anchor_kl"], rel=1e-5)
    _close(peft_model, "whole", "sliced")


def test_sliced_step_has_the_whole_steps_gradients(model_and_rows):
    """Before any update: the gradients one sliced step accumulates equal the whole step's."""
    from kiln.training.core.loop import TrainLoop, token_mean_pieces
    from kiln.training.losses.chunked import sft_loss_from_hidden, split_causal_lm

    peft_model, rows, pad = model_and_rows
    add_private_adapter(peft_model, "g", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    loop = TrainLoop(peft_model, "g", Plan(1e-3, 1, 6, 0), Hooks(), 1, None)
    split = split_causal_lm(peft_model)
    batch = collate(rows, pad, loop.device)

    def loss_of(b):
        return sft_loss_from_hidden(split.hidden(b["input_ids"]), split.head.weight, b["input_ids"], b["loss_mask"])

    with loop.step_ownership():
        loss_of(batch).backward()
    whole = [p.grad.clone() for p in loop.params]
    loop.opt.zero_grad(set_to_none=True)
    pieces = token_mean_pieces(batch, 40, loss_of)
    assert len(pieces) > 2 and sum(p.weight for p in pieces) == pytest.approx(1.0)
    for piece in pieces:
        (piece.loss() * piece.weight).backward()
    for g, p in zip(whole, loop.params):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_sliced_grpo_follows_the_whole_step_trajectory(model_and_rows):
    peft_model, rows, pad = model_and_rows
    items = [GRPOItem(rows[0:3], torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64)),
             GRPOItem(rows[3:6], torch.tensor([-1.0, 0.2, 0.8], dtype=torch.float64))]
    plan = Plan(5e-3, 3, 2, 0)
    settings = GRPOSettings(kl_coef=0.1)
    reports = {}
    for name, budget in (("gw", None), ("gs", 1e-9)):
        holds = CountingHolds(budget)
        add_private_adapter(peft_model, name, lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
        reports[name] = run_grpo(peft_model, name, items, plan, settings, pad_id=pad, hooks=holds.hooks(),
                                 anchor=_anchor(rows[:2]))
        assert holds.holds >= (2 if budget is None else 6)  # the behaviour log-probs: one hold per group
    assert reports["gs"].extra["sliced_steps"] == reports["gs"].steps == 3
    assert reports["gs"].final_loss == pytest.approx(reports["gw"].final_loss, rel=1e-4, abs=1e-6)
    _close(peft_model, "gw", "gs")


def test_row_groups_and_sub_batch():
    assert row_groups([5, 5, 5, 20, 1], 10) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert row_groups([3, 3], 100) == [range(0, 2)]
    assert row_groups([], 10) == []
    batch = collate([Row([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), Row([6, 7], [0, 1]), Row([8, 9, 10], [0, 1, 1])], 0,
                    torch.device("cpu"))
    sb = sub_batch(batch, range(1, 3))
    assert sb["input_ids"].tolist() == [[6, 7, 0], [8, 9, 10]]  # the columns past the longest row dropped
    assert sb["loss_mask"].shape == sb["attention_mask"].shape == (2, 3)


@pytest.mark.parametrize("loss", ["forward", "sampled_token"])
def test_opd_pieces_have_the_whole_steps_gradients(model_and_rows, loss):
    """OPD's step cut into completion groups and gold groups: the same gradients as :func:`opd_loss` of the batch."""
    from dataclasses import dataclass

    from kiln.training.core.loop import TrainLoop
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.opd.step import opd_loss, opd_pieces

    @dataclass(frozen=True)
    class Settings:
        loss: str
        top_k: int = 4
        ce_weight: float = 0.3
        temperature: float = 0.7

    peft_model, rows, pad = model_and_rows
    add_private_adapter(peft_model, "o", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    holds = CountingHolds(1e-9)  # each piece also cut between its decoder layers
    loop = TrainLoop(peft_model, "o", Plan(1e-3, 1, 6, 0), holds.hooks(), 1, None)
    pairs = [(r.input_ids[:r.loss_mask.index(1)], r.input_ids[r.loss_mask.index(1):]) for r in rows]
    sampled = [t for _, c in pairs for t in c]
    g = torch.Generator().manual_seed(2)
    teacher = [{t: -0.5, **{int(v): -2.0 - j for j, v in enumerate(torch.randint(0, 200, (4,), generator=g))}}
               for t in sampled]
    gold = [(p, c[:3]) for p, c in pairs[:4]]
    data = Settings(loss)
    split = split_causal_lm(peft_model)
    grads = []
    for sliced in (False, True):
        loop.opt.zero_grad(set_to_none=True)
        if sliced:
            pieces = opd_pieces(peft_model, split, data, (pairs, teacher, sampled, gold), 30, pad_id=pad,
                                device=loop.device)
            assert len(pieces) >= 4
            holds.holds = 0
            for piece in pieces:
                loop.run_piece(piece)
            assert holds.holds > 2 * len(pieces)
        else:
            with loop.step_ownership():
                opd_loss(peft_model, split, data, pairs, teacher, sampled, gold, pad_id=pad, device=loop.device).backward()
        grads.append([p.grad.clone() for p in loop.params])
    scale = max(float(a.abs().max()) for a in grads[0])
    assert scale > 0
    for a, b in zip(*grads):  # float32 sums in another order: close to the largest gradient's scale
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * scale)


def test_kd_pieces_have_the_whole_steps_gradients(model_and_rows):
    """Sparse KD's step cut into groups of windows: the same gradients as the whole batch's loss (KD and CE terms
    are both means over the captured positions)."""
    from types import SimpleNamespace

    import numpy as np

    from kiln.training.core.loop import TrainLoop
    from kiln.training.kd.job import _KDStep
    from kiln.training.losses.kd import SparseKDLoss
    from kiln.training.losses.kd_batch import kd_loss_split

    peft_model, rows, pad = model_and_rows
    add_private_adapter(peft_model, "k", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    holds = CountingHolds(1e-9)  # each piece also cut between its decoder layers
    loop = TrainLoop(peft_model, "k", Plan(1e-3, 1, 6, 0), holds.hooks(), 1, None)
    k, rng = 4, np.random.default_rng(3)
    examples, windows = [], []
    for n, r in enumerate(rows):
        m = len(r.input_ids) - 1
        top = rng.integers(0, 200, (m, k))
        lp = np.log(0.8 * rng.dirichlet(np.ones(k), m))
        examples.append(SimpleNamespace(forced=np.array(r.input_ids[1:]), forced_logprobs=np.full(m, np.nan),
                                        top_ids=top, top_logprobs=lp, tail=np.full(m, 0.2)))
        windows.append((list(r.input_ids), [(i, n, i) for i in range(m)]))
    step = object.__new__(_KDStep)  # the step's loss and slicer, without a capture on disk
    step.peft_model, step.loop, step.examples, step.anchor, step.pad_id = peft_model, loop, examples, None, pad
    step.cplan = SimpleNamespace(probability=SimpleNamespace(top_k=k), tokenizer=SimpleNamespace(vocab_size=600))
    step.loss_fn, step.use_ce = SparseKDLoss(ce_weight=0.5, kd_weight=1.0, temperature=1.0), True
    step.split = kd_loss_split(peft_model)
    grads = []
    for sliced in (False, True):
        loop.opt.zero_grad(set_to_none=True)
        if sliced:
            pieces = step.pieces(windows, 40)
            assert len(pieces) >= 3 and sum(p.weight for p in pieces) == pytest.approx(1.0)
            holds.holds = 0
            for piece in pieces:
                loop.run_piece(piece)
            assert holds.holds > 2 * len(pieces)
        else:
            with loop.step_ownership():
                step.loss(windows).backward()
        grads.append([p.grad.clone() for p in loop.params])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def _rows_loss(split):
    from kiln.training.losses.chunked import sft_loss_from_hidden

    def loss_of(b):
        return sft_loss_from_hidden(split.hidden(b["input_ids"]), split.head.weight, b["input_ids"], b["loss_mask"])
    return loss_of


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_row_cut_between_layers_has_the_whole_steps_gradients(model_and_rows, checkpointing):
    """A tiny budget: every row's forward and backward cut between its decoder layers (holds of one layer each,
    activations kept across them), with and without checkpointed layers; the gradients are the whole step's."""
    from kiln.training.core.loop import TrainLoop, token_mean_pieces
    from kiln.training.core.step import TrunkRunner
    from kiln.training.losses.chunked import split_causal_lm

    peft_model, rows, pad = model_and_rows
    add_private_adapter(peft_model, "r", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    holds = CountingHolds(1e-9)
    loop = TrainLoop(peft_model, "r", Plan(1e-3, 1, 6, 0), holds.hooks(), 1, None)
    assert loop.layer_holds is not None
    layers = len(loop.layer_holds.layers)
    split = split_causal_lm(peft_model)
    runner = TrunkRunner(peft_model, split, gradient_checkpointing=checkpointing, compile=False)
    batch = collate(rows, pad, loop.device)
    loss_of = _rows_loss(split)
    with loop.step_ownership(), runner.training():
        whole_loss = loss_of(batch)
        whole_loss.backward()
    whole = [p.grad.clone() for p in loop.params]
    loop.opt.zero_grad(set_to_none=True)
    pieces = token_mean_pieces(batch, 1, loss_of)  # one row each
    holds.holds = 0
    total = sum(loop.run_piece(piece, runner.training)[0] for piece in pieces)
    # each row: a hold per layer's forward, the head and last layer's backward, a hold per other layer's backward
    assert holds.holds >= len(pieces) * 2 * layers
    assert layers >= 2 and total == pytest.approx(float(whole_loss.detach()), rel=1e-5)
    for g, p in zip(whole, loop.params):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    assert all(not layer._forward_pre_hooks for layer in loop.layer_holds.layers)  # nothing left installed


def test_layer_holds_off_or_idle_keeps_a_piece_one_hold(model_and_rows):
    from kiln.training.core.loop import TrainLoop, token_mean_pieces
    from kiln.training.losses.chunked import split_causal_lm

    peft_model, rows, pad = model_and_rows
    add_private_adapter(peft_model, "n", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    split = split_causal_lm(peft_model)
    batch = collate(rows, pad, torch.device("cpu"))
    for budget, layer_holds in ((1e-9, False), (None, True)):
        holds = CountingHolds(budget)
        loop = TrainLoop(peft_model, "n", Plan(1e-3, 1, 6, 0), Hooks(exclusive=holds.hooks().exclusive,
                         hold_budget=lambda: budget, layer_holds=layer_holds), 1, None)
        assert (loop.layer_holds is None) == (not layer_holds)
        pieces = token_mean_pieces(batch, 1, _rows_loss(split))
        for piece in pieces:
            loop.run_piece(piece)
        assert holds.holds == len(pieces)
        loop.opt.zero_grad(set_to_none=True)


def test_a_hybrid_row_cut_between_layers_has_the_whole_steps_gradients(builtin_model_dir, tmp_path):
    """Qwen3.5's Gated DeltaNet and full-attention layers (no split head: the model's own logits) cut between
    layers: the whole step's gradients."""
    from peft import get_peft_model

    from kiln.runtime.loader import load_model
    from kiln.training.core.loop import TrainLoop, token_mean_pieces
    from kiln.training.losses.sft import sft_loss
    from tests.hybrid_models import build_tiny_hybrid

    lm = load_model(build_tiny_hybrid(tmp_path / "hybrid", builtin_model_dir), device="cpu")
    targets = ["q_proj", "v_proj", "down_proj"]  # down_proj: a LoRA in every layer, linear-attention ones too
    peft_model = get_peft_model(lm.model, lora_config(4, 8, targets), adapter_name="idle")
    add_private_adapter(peft_model, "h", lora_config(4, 8, targets), seed=0)
    holds = CountingHolds(1e-9)
    loop = TrainLoop(peft_model, "h", Plan(1e-3, 1, 6, 0), holds.hooks(), 1, None)
    assert loop.layer_holds is not None
    batch = collate(tokenize_sft(lm.tokenizer, EXAMPLES, max_seq_len=512), lm.tokenizer.pad_token_id, loop.device)

    def loss_of(b):
        return sft_loss(peft_model(input_ids=b["input_ids"], use_cache=False).logits, b["input_ids"], b["loss_mask"])

    with loop.step_ownership():
        loss_of(batch).backward()
    grads = {"whole": [p.grad.clone() for p in loop.params]}
    cut_holds = loop.layer_holds
    for label, layer_holds in (("rows", None), ("layers", cut_holds)):
        loop.opt.zero_grad(set_to_none=True)
        loop.layer_holds, holds.holds = layer_holds, 0
        for piece in token_mean_pieces(batch, 1, loss_of):
            loop.run_piece(piece)
        grads[label] = [p.grad.clone() for p in loop.params]
    assert holds.holds >= 6 * 2 * len(cut_holds.layers)
    scale = max(float(g.abs().max()) for g in grads["whole"])
    for w, r, c in zip(grads["whole"], grads["rows"], grads["layers"]):
        torch.testing.assert_close(c, r, rtol=1e-6, atol=1e-9)  # the cut between layers: the same sums
        # rows vs the padded batch: DeltaNet's chunked scan sums in another order over another length
        torch.testing.assert_close(c, w, rtol=1e-4, atol=1e-5 * scale)


def test_a_forward_without_gradients_cut_between_layers_computes_the_same(model_and_rows):
    """The learned check's forward (and GRPO's behaviour log-probs) run through ``forward_holds``: holds that end
    between layers, the same margin."""
    from kiln.training.core.loop import TrainLoop, greedy_margin

    peft_model, rows, pad = model_and_rows
    add_private_adapter(peft_model, "f", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    holds = CountingHolds(1e-9)
    loop = TrainLoop(peft_model, "f", Plan(1e-3, 1, 6, 0), holds.hooks(), 1, None)
    with loop.step_ownership():
        whole = greedy_margin(peft_model, rows, pad_id=pad, batch_size=3)
    holds.holds = 0
    cut = loop.forward_holds(lambda: greedy_margin(peft_model, rows, pad_id=pad, batch_size=3))
    assert cut == pytest.approx(whole, rel=1e-6, abs=1e-6)
    assert holds.holds >= 2 * len(loop.layer_holds.layers)  # two batches, a hold per layer
    assert loop.layer_holds.snapshot()["forward_ms"] > 0


def test_a_whole_step_begun_idle_is_cut_when_a_chat_arrives(model_and_rows):
    """Serving idle when the step begins (no slicing), busy from its first layer on: the step's one piece is cut
    between layers at once instead of making the chat wait for the whole step."""
    peft_model, rows, pad = model_and_rows
    calls = {"n": 0}

    def budget():  # the step's pieces() and its first hold see an idle server, every later check a busy one
        calls["n"] += 1
        return None if calls["n"] <= 2 else 1e-9

    holds = CountingHolds(None)
    hooks = Hooks(exclusive=holds.hooks().exclusive, hold_budget=budget)
    add_private_adapter(peft_model, "w", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    report = run_sft(peft_model, "w", rows, Plan(5e-3, 1, 6, 0, max_steps=1), pad_id=pad, hooks=hooks)
    assert report.steps == 1 and "sliced_steps" not in report.extra
    assert holds.holds > 2 * report.extra["layer_holds"]["holds"] // 2 > 4  # cut between layers, not one hold


def test_layer_holds_cuts_is_the_units_total_over_the_longest():
    from torch import nn

    from kiln.training.core.segments import LayerHolds

    holds = LayerHolds([nn.Identity() for _ in range(4)], lambda: None, lambda: None)  # type: ignore[arg-type]
    assert holds.cuts() == 1.0  # nothing timed yet
    holds.estimate_s.update(forward=0.01, head=0.02, first_backward=0.03, backward=0.02)
    # 4 forwards + head + first backward + 3 backwards = 0.04 + 0.02 + 0.03 + 0.06 = 0.15, over the longest 0.03
    assert holds.cuts() == pytest.approx(5.0)
    holds.estimate_s["head"] = 1.0  # a head far longer than the rest: the piece can hardly be cut
    assert holds.cuts() == pytest.approx(1.13)  # (0.04 + 1.0 + 0.03 + 0.06) / 1.0


def test_an_idle_step_whose_layer_would_outlast_a_hold_is_split_and_trains_the_same(model_and_rows):
    """With serving idle a step is one piece, unless one of its layer units would outlast training.max_hold_ms
    should a chat arrive mid-step (max_hold): then it is split as if that were the budget. Not counted as a
    sliced step (serving did not wait), and the adapter trains as the whole steps do."""
    peft_model, rows, pad = model_and_rows
    plan = Plan(5e-3, 3, 6, 0)
    whole = _sft(peft_model, rows, pad, "idle-whole", plan, CountingHolds(None))
    counted = CountingHolds(None)
    hooks = Hooks(exclusive=counted.hooks().exclusive, hold_budget=lambda: None, max_hold=lambda: 1e-9)
    add_private_adapter(peft_model, "idle-split", lora_config(4, 8, ["q_proj", "v_proj"]), seed=plan.seed)
    split = run_sft(peft_model, "idle-split", rows, plan, pad_id=pad, hooks=hooks)
    assert whole.steps == split.steps == 3 and "sliced_steps" not in split.extra
    # the first step is one piece (no time per token measured yet), the next two one row per piece
    assert counted.holds > 3 * 2 + 2 * (len(rows) - 1)
    assert split.final_loss == pytest.approx(whole.final_loss, rel=1e-5)
    _close(peft_model, "idle-whole", "idle-split")


def test_busy_pieces_are_sized_for_the_holds_layer_cuts_make(model_and_rows):
    """While serving waits, a piece holds budget x cuts / seconds-per-token tokens: layer cuts split it into
    holds of about the budget, so pieces need not be as small as one hold's whole forward and backward."""
    from kiln.training.core.loop import TrainLoop

    peft_model, _rows, _pad = model_and_rows
    add_private_adapter(peft_model, "sizes", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    loop = TrainLoop(peft_model, "sizes", Plan(1e-3, 1, 6, 0), Hooks(hold_budget=lambda: 0.05), 1, None)
    asked: list[int] = []

    def slicer(batch, limit):
        asked.append(limit)
        return [batch]

    loop.s_per_token = 0.001
    loop.pieces("batch", slicer)
    assert asked == [50]  # nothing timed yet: one hold's worth (0.05 s / 1 ms)
    assert loop.layer_holds is not None
    loop.layer_holds.estimate_s.update(forward=0.01, head=0.01, first_backward=0.02, backward=0.02)
    loop.pieces("batch", slicer)
    layers = len(loop.layer_holds.layers)
    cuts = (layers * 0.01 + 0.01 + 0.02 + (layers - 1) * 0.02) / 0.02
    assert asked[-1] == int(0.05 * cuts / 0.001)
