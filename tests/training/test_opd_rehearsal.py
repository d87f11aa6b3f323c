"""OPD rehearsal rows (kiln.training.core.rehearsal) on the built-in model: the questions the base model writes,
its answers and rows, what a step trains on, and the checkpoint round trip."""

from __future__ import annotations

import pytest
import torch

from kiln.training.core.rehearsal import Rehearsal, RehearsalRow, questions_from_tensor, user_turn_prefix


def test_user_turn_prefix_is_the_template_up_to_the_content():
    render = lambda msgs: f"<s>[{msgs[0]['role']}]{msgs[0]['content']}</s>"  # noqa: E731
    assert user_turn_prefix(render, lambda t: [ord(c) for c in t]) == [ord(c) for c in "<s>[user]"]
    assert user_turn_prefix(lambda msgs: "no content here", lambda t: [1]) == []


def test_rows_are_handed_out_in_turn_and_questions_survive_a_checkpoint():
    items = [RehearsalRow((1,), (2,), ({2: -0.1},)), RehearsalRow((3,), (4,), ({4: -0.2},)),
             RehearsalRow((5,), (6,), ({6: -0.3},))]
    r = Rehearsal([[7, 8], [9]], items)
    assert [x.prompt for x in r.for_step(0, 2)] == [(1,), (3,)]
    assert [x.prompt for x in r.for_step(1, 2)] == [(5,), (1,)]  # wraps around
    assert Rehearsal([], []).for_step(3, 4) == [] and r.for_step(0, 0) == []
    pairs, rows, tokens = [((0,), (1,))], [{1: -0.5}], [1]  # a step's sample, then its rehearsal rows
    assert r.add_to_step(1, 2, pairs, rows, tokens) == 2
    assert pairs == [((0,), (1,)), ((5,), (6,)), ((1,), (2,))] and tokens == [1, 6, 2]
    assert rows == [{1: -0.5}, {6: -0.3}, {2: -0.1}]
    assert questions_from_tensor(r.tensors()["opd_rehearsal_questions"]) == [[7, 8], [9]]
    assert questions_from_tensor(Rehearsal([], []).to_tensor()) == []


@pytest.fixture(scope="module")
def student(builtin_model_dir):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.training.core.lora import lora_config
    from kiln.training.core.templates import end_of_turn_ids

    tok = AutoTokenizer.from_pretrained(str(builtin_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(builtin_model_dir), dtype=torch.float32)
    end_ids = sorted(end_of_turn_ids(tok, model.generation_config))
    pm = get_peft_model(model, lora_config(4, 8, ["q_proj", "v_proj"]))
    return pm, tok, end_ids


def _chat(tok, text: str) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def test_the_base_model_writes_questions_and_its_answers_are_the_rehearsal_rows(student):
    """Questions sampled from the base model after the user-turn prefix (seeded: the same twice), repeats and the
    job's own prompts dropped, each answered greedily by the base model (the adapter disabled, whatever its
    weights), and each row holds the base's top-K log-probabilities plus the answer token's."""
    from kiln.training.core.rehearsal import build_rehearsal, write_questions

    pm, tok, end_ids = student
    pad = tok.pad_token_id if tok.pad_token_id is not None else end_ids[0]
    prefix = user_turn_prefix(lambda m: tok.apply_chat_template(m, tokenize=False),
                              lambda t: tok.encode(t, add_special_tokens=False))
    assert prefix and tok.decode(prefix).strip().endswith("user")
    qs = write_questions(pm, prefix, 12, 24, seed=3, pad_id=pad, end_ids=end_ids, device="cpu")
    assert qs == write_questions(pm, prefix, 12, 24, seed=3, pad_id=pad, end_ids=end_ids, device="cpu")
    assert len(qs) >= 6 and not any(set(q) & set(end_ids) for q in qs)
    with torch.no_grad():  # an adapter that has moved: rehearsal must still hold the base model's answers
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    own = _chat(tok, tok.decode(qs[0]).strip())
    r = build_rehearsal(pm, qs, chat_prompt=lambda q: _chat(tok, tok.decode(q).strip()), exclude=[own],
                        max_tokens=24, top_k=4, pad_id=pad, end_ids=end_ids, device="cpu")
    prompts = [it.prompt for it in r.items]
    assert len(r) >= 1 and tuple(own) not in prompts and len(set(prompts)) == len(prompts)
    for it in r.items:
        seq = list(it.prompt) + list(it.answer)
        with torch.no_grad(), pm.disable_adapter():
            logp = pm(input_ids=torch.tensor([seq])).logits[0].float().log_softmax(-1)
        for j, t in enumerate(it.answer):
            at = logp[len(it.prompt) - 1 + j]
            assert t == int(at.argmax()) or t in end_ids  # greedy (through the end-of-turn token)
            top = set(at.topk(4).indices.tolist()) | {t}
            assert set(it.rows[j]) == top
            assert all(abs(v - float(at[k])) < 1e-4 for k, v in it.rows[j].items())
        assert it.answer[-1] in end_ids or len(it.answer) == 24


def test_rehearsal_defaults_follow_the_reference_policy():
    """On by default on policy; off for off-policy jobs and for a job continuing a published adapter (its
    reference would be the bare base model, pulling the parent's unrelated answers back); explicit values stay."""
    from kiln.training.opd.schemas import DEFAULT_OPD_REHEARSAL, OPDRequest

    body = {"adapter": "student", "teacher": "tutor",
            "prompts": [{"messages": [{"role": "user", "content": "Which bird guards the old mill?"}]}]}
    assert OPDRequest.model_validate(body).rehearsal == DEFAULT_OPD_REHEARSAL
    assert OPDRequest.model_validate(body | {"base_adapter": "parent"}).rehearsal == 0
    assert OPDRequest.model_validate(body | {"base_adapter": "parent", "rehearsal": 8}).rehearsal == 8
