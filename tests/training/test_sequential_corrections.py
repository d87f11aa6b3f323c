"""Learning that keeps what the model knew: the KL-to-base anchor (kiln.training.core.anchor) and sequential
corrections that replay the adapter's stored ones (kiln.training.sft.corrections), unit and through a real server."""

from __future__ import annotations

import shutil

import pytest
import torch

from kiln.demo import wait_job
from kiln.runtime.builtin import BUILTIN_NAME
from kiln.training.sft.corrections import bounded, stored_corrections, with_corrections
from kiln.training.schemas import DEFAULT_SFT_WEIGHT_DECAY, SFTExample
from tests.zygote import kiln_server

FACTS = [("Which bird guards the old mill?", "The old mill is guarded by a heron."),
         ("What is the name of the red boat?", "The red boat is called Marlow."),
         ("Who bakes bread in the village?", "Old Tessa bakes the bread.")]


def _example(q: str, a: str) -> SFTExample:
    return SFTExample.model_validate({"messages": [{"role": "user", "content": q},
                                                   {"role": "assistant", "content": a}]})


class _Record:  # what with_corrections reads of an AdapterRecord
    def __init__(self, config):
        self.manifest = type("M", (), {"config": config})()


# ------------------------------------------------------------------------------------------ corrections


def test_a_new_correction_replaces_the_stored_one_for_the_same_question_and_keeps_the_others():
    parent = _Record({"corrections": [_example(*FACTS[0]).model_dump(mode="json"),
                                      _example(*FACTS[1]).model_dump(mode="json")]})
    new = [_example(FACTS[1][0], "The red boat is called Ysolde.")]
    train, record, replayed = with_corrections(parent, new, replay=True)
    assert replayed == 1 and [e.messages[-1].content for e in train] == [FACTS[0][1], "The red boat is called Ysolde."]
    assert [e["messages"][-1]["content"] for e in record] == [FACTS[0][1], "The red boat is called Ysolde."]
    # without replay only the job's own examples are trained and recorded
    train, record, replayed = with_corrections(parent, new, replay=False)
    assert replayed == 0 and len(train) == 1 and len(record) == 1
    assert stored_corrections(None) == [] and stored_corrections(_Record({"corrections": "x"})) == []


def test_stored_corrections_are_bounded_newest_kept():
    items = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * 100}]}
             for i in range(50)]
    kept = bounded(items, limit=1_000)
    assert 0 < len(kept) < 50 and kept == items[-len(kept):]
    assert bounded(items) == items


# ------------------------------------------------------------------------------------------ the anchor


@pytest.fixture(scope="module")
def peft_builtin(builtin_model_dir):
    from peft import get_peft_model

    from kiln.runtime.loader import load_model
    from kiln.training.core.templates import end_of_turn_ids
    from kiln.training.core.lora import lora_config

    lm = load_model(str(builtin_model_dir), device="cpu", dtype="float32")
    end_ids = sorted(end_of_turn_ids(lm.tokenizer, lm.model.generation_config))
    return get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle"), lm.tokenizer, end_ids


def test_the_anchor_is_zero_at_the_base_and_pulls_a_moved_adapter_back(peft_builtin):
    """The anchor's rows are the base model's own answers with its top-K rows: a fresh adapter (LoRA B = 0) is
    the base, so the KL is ~0; a perturbed adapter has a positive KL whose gradient reaches the adapter."""
    from kiln.training.core.anchor import Anchor, AnchorSettings, anchor_rows
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.core.lora import add_private_adapter, lora_config

    pm, tok, end_ids = peft_builtin
    settings = AnchorSettings(questions=8, per_step=4, weight=1.0, max_tokens=16)
    rows = anchor_rows(pm, tok, settings, pad_id=tok.pad_token_id, end_ids=end_ids)
    assert rows and all(r.row.loss_mask.count(1) == r.ids.shape[0] for r in rows)
    assert all(0.0 <= float(t) <= 1.0 for r in rows for t in r.tail)
    anchor = Anchor(rows, settings)
    params = add_private_adapter(pm, "anchored", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
    pm.base_model.set_adapter("anchored")
    split = split_causal_lm(pm)
    at_base = anchor.loss(pm, split, 0, tok.pad_token_id, "cpu")
    assert at_base is not None and abs(float(at_base.detach())) < 1e-4
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    moved = anchor.loss(pm, split, 0, tok.pad_token_id, "cpu")
    assert float(moved.detach()) > 1e-3
    moved.backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in params)
    # a job's own prompts are left out of its anchor
    own = [list(rows[0].prompt) + [1, 2, 3]]
    assert len(anchor.without(own)) == len(rows) - sum(r.prompt == rows[0].prompt for r in rows)


def test_an_anchor_on_given_questions_answers_exactly_those(peft_builtin):
    """``anchor_rows(questions=...)``: one row per distinct question, its prompt the question's chat prompt and
    its answer the base's greedy answer (what bench/locality.py's world-question anchor uses)."""
    from kiln.training.core.anchor import AnchorSettings, anchor_rows
    from kiln.training.core.data import grpo_prompt_ids

    pm, tok, end_ids = peft_builtin
    settings = AnchorSettings(questions=8, per_step=4, weight=1.0, max_tokens=16)
    asked = ["What is the capital of France?", "Which bird guards the old mill?", "What is the capital of France?"]
    rows = anchor_rows(pm, tok, settings, pad_id=tok.pad_token_id, end_ids=end_ids, questions=asked)
    prompts = [tuple(grpo_prompt_ids(tok, [{"role": "user", "content": q}])) for q in asked[:2]]
    assert [r.prompt for r in rows] == prompts
    assert all(r.row.loss_mask.count(1) == r.ids.shape[0] > 0 for r in rows)
    pm.delete_adapter("anchored")


def test_weight_decay_keeps_the_adapter_smaller_on_the_same_steps(peft_builtin):
    """The plan's ``weight_decay`` reaches the optimizer: the same correction, the same seed and fixed steps,
    with decay ends with a smaller adapter (every step pulls it towards zero: the base) than without."""
    from kiln.training.core.data import tokenize_sft
    from kiln.training.core.loop import Plan
    from kiln.training.core.lora import adapter_state, add_private_adapter, lora_config
    from kiln.training.sft.job import run_sft

    pm, tok, end_ids = peft_builtin
    rows = tokenize_sft(tok, [_example(*FACTS[0])], max_seq_len=128, end_ids=end_ids)
    norms = {}
    for decay in (0.0, 5.0):
        add_private_adapter(pm, "decayed", lora_config(4, 8, ["gate_proj", "up_proj", "down_proj"]), seed=0)
        report = run_sft(pm, "decayed", rows, Plan(5e-3, 12, 1, 0, max_steps=12, weight_decay=decay),
                         pad_id=tok.pad_token_id)
        assert report.steps == 12
        norms[decay] = sum(float(v.norm() ** 2) for v in adapter_state(pm, "decayed").values()) ** 0.5
        pm.delete_adapter("decayed")
    assert norms[5.0] < 0.97 * norms[0.0], norms


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def home(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    return home


def test_sequential_corrections_onto_one_adapter_keep_the_earlier_ones(home):
    """Two corrections of different facts, each continuing the adapter the one before published, with the
    request defaults: every job reproduces all corrections so far (the learned check covers the replayed ones),
    the served adapter answers both as corrected (OpenAI client, greedy), the revision records the
    corrections, and the locality measure finds no degenerate answer."""
    import openai

    with kiln_server(home) as server:
        c = server.client
        for i, (q, a) in enumerate(FACTS[:2]):
            body = {"adapter": "facts", "auto_load": True, **({"base_adapter": "facts"} if i else {}),
                    "examples": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}]}
            r = c.post("/v1/train/sft", json=body)
            assert r.status_code == 202, r.text
            job = wait_job(c, r.json()["id"])
            assert job["state"] == "succeeded", job["error"]
            report = job["result"]["report"]
            assert report["learned"] is True and report["greedy_margin"] >= 1.0
            assert report["anchor_rows"] > 0 and report["anchor_kl"] >= 0
            assert job["result"]["activated"] is True, job["result"].get("held_back")
            assert job["result"]["locality"]["degenerate"] == 0
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        for q, a in FACTS[:2]:
            out = client.chat.completions.create(model="facts", messages=[{"role": "user", "content": q}],
                                                 temperature=0, max_tokens=32)
            assert out.choices[0].message.content.strip() == a
        adapter = c.get("/v1/adapters/facts").json()
        stored = adapter["manifest"]["config"]["corrections"]
        assert [e["messages"][-1]["content"] for e in stored] == [a for _, a in FACTS[:2]]
        assert adapter["manifest"]["config"]["replayed_corrections"] == 1
        assert adapter["manifest"]["config"]["weight_decay"] == DEFAULT_SFT_WEIGHT_DECAY > 0


def test_anchor_prompts_are_rehearsed_beside_the_base_questions(home):
    """``anchor_prompts``: the caller's own questions join the anchor (answered by the base model), so the job
    rehearses them beside the base's own questions; recorded in the effective request; a job with
    ``anchor_questions`` 0 and prompts anchors on the prompts alone."""
    mine = ["What is the capital of France?", "Where is the library?"]
    with kiln_server(home) as server:
        c = server.client
        rows = {}
        for name, extra in (("plain", {}), ("mine", {"anchor_prompts": mine}),
                            ("only", {"anchor_prompts": mine, "anchor_questions": 0})):
            body = {"adapter": f"anchored-{name}", "examples": [{"messages": [
                {"role": "user", "content": FACTS[2][0]}, {"role": "assistant", "content": FACTS[2][1]}]}], **extra}
            r = c.post("/v1/train/sft", json=body)
            assert r.status_code == 202, r.text
            job = wait_job(c, r.json()["id"])
            assert job["state"] == "succeeded", job["error"]
            rows[name] = job["result"]["report"]["anchor_rows"]
        assert rows["mine"] == rows["plain"] + len(mine) and rows["only"] == len(mine), rows
        config = c.get("/v1/adapters/anchored-mine").json()["manifest"]["config"]
        assert config["anchor_prompts"] == mine and config["anchor_weight"] > 0
        r = c.post("/v1/train/sft", json={"adapter": "x", "anchor_prompts": [""], "examples": [{"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "anchor_prompts[0]"
