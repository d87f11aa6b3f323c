"""Student-only sparse-KD training: dense equivalence at K = V, exactly-once
consumption through the ledger, output adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.distill.ledger import Ledger
from kiln.distill.examples import available_shards, forward_windows, load_shard_examples
from kiln.distill.train import train_sparse_kd
from kiln.training.losses.kd_batch import batch_tensors

from tests.distill.tinymodels import capture_in_process, make_plan, synthetic_examples, tiny_pair  # noqa: F401

torch = pytest.importorskip("torch")


def test_offline_sparse_kd_gradient_equals_dense_kd_at_full_vocabulary(tmp_path, tiny_pair):
    """K = V: the gradient from the captured shard equals dense KD from live teacher logits (1e-6)."""
    teacher, student = tiny_pair
    examples = synthetic_examples(3, 32, prompt=3, target=4)
    plan_path, plan, data = make_plan(tmp_path, teacher, student, examples, top_k=32, max_len=5, widths=(4, 8, 8, 8))
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run", examples_per_shard=8)
    plan, todo, _ = available_shards(tmp_path / "run")
    (shard_dir, head), = todo
    exs = load_shard_examples(shard_dir, head, plan)
    windows = forward_windows(exs, plan.capture.max_sequence_length)
    ids, att, rows, offs, sel, lp, mask, tail, target = batch_tensors(windows, exs, 32, 32, "cpu", True)
    assert float(tail.abs().max()) == 0.0 and bool(mask[:, :32].all()) and not bool(mask[:, 32].any())

    from transformers import AutoModelForCausalLM

    from kiln.training.losses.kd import SparseKDLoss

    t_model = AutoModelForCausalLM.from_pretrained(teacher).eval()  # float32, as captured
    with torch.no_grad():
        t_lp = torch.log_softmax(t_model(input_ids=ids, attention_mask=att).logits[rows, offs].double(), -1)
    grads = []
    for use_sparse in (True, False):
        s_model = AutoModelForCausalLM.from_pretrained(student).double()  # precision of the comparison, not of KD
        logits = s_model(input_ids=ids, attention_mask=att).logits[rows, offs]
        if use_sparse:
            loss, _ = SparseKDLoss(ce_weight=0.0, kd_weight=1.0)(logits, sel, lp.double(), mask, tail, target)
        else:
            loss = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), t_lp, log_target=True,
                                              reduction="none").sum(-1).mean()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in s_model.parameters()]))
    assert torch.max(torch.abs(grads[0] - grads[1])).item() < 1e-6


def test_training_consumes_each_shard_exactly_once_and_writes_a_peft_adapter(tmp_path, tiny_pair):
    teacher, student = tiny_pair
    examples = synthetic_examples(4, 32, prompt=3, target=4)
    plan_path, plan, data = make_plan(tmp_path, teacher, student, examples, top_k=4)
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run", examples_per_shard=2)
    out = tmp_path / "train"
    first = train_sparse_kd(tmp_path / "run", student, out, batch_size=2)
    assert [s["action"] for s in first["shards"]] == ["trained", "trained"]
    adapter = Path(first["adapter"])
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
    again = train_sparse_kd(tmp_path / "run", student, out, batch_size=2)
    assert [s["action"] for s in again["shards"]] == ["already-committed"] * 2
    assert again["checkpoint_sha256"] == first["checkpoint_sha256"]
    for shard_dir, head in available_shards(tmp_path / "run")[1]:
        ledger = Ledger(tmp_path / "run" / ".consumption" / f"{head.transaction_id}.jsonl", shard_dir, plan)
        assert [e.action for e in ledger.events] == ["reserve", "commit"]
    # A different configuration in the same directory is refused, not mixed in.
    from kiln.distill.errors import ContractError

    with pytest.raises(ContractError, match="different training configuration"):
        train_sparse_kd(tmp_path / "run", student, out, batch_size=3)
    from typer.testing import CliRunner

    from kiln.distill.cli import app

    res = CliRunner().invoke(app, ["status", str(tmp_path / "run"), "--train-dir", str(out)])
    assert [(x["state"], x["commits"]) for x in json.loads(res.stdout)["ledgers"]] == [("committed", 1)] * 2


def test_student_must_match_the_plan(tmp_path, tiny_pair):
    teacher, student = tiny_pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(2, 32), top_k=4)
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run")
    from kiln.distill.errors import ContractError

    with pytest.raises(ContractError, match="student"):
        train_sparse_kd(tmp_path / "run", teacher, tmp_path / "train")
    assert not (tmp_path / "train").exists()


def test_cli_train_prints_one_json_line(tmp_path, tiny_pair):
    from typer.testing import CliRunner

    from kiln.distill.cli import app

    teacher, student = tiny_pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(2, 32), top_k=4)
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run")
    res = CliRunner().invoke(app, ["train", str(tmp_path / "run"), "--student", str(student),
                                   "--out", str(tmp_path / "train"), "--batch-size", "2"])
    assert res.exit_code == 0, res.stdout
    line, = res.stdout.strip().splitlines()
    assert json.loads(line)["shards"][0]["action"] == "trained"
    res = CliRunner().invoke(app, ["train", str(tmp_path / "run"), "--out", str(tmp_path / "t2")])
    assert res.exit_code == 2 and json.loads(res.stdout)["error"]["code"] == "missing_option"


def test_epochs_replay_teacher_expert_shards_through_chained_reservations(tmp_path, tiny_pair):
    teacher, student = tiny_pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(2, 32), top_k=4)
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run")
    out = tmp_path / "train"
    train_sparse_kd(tmp_path / "run", student, out, batch_size=2)
    second = train_sparse_kd(tmp_path / "run", student, out, batch_size=2, epochs=2)
    assert [s["action"] for s in second["shards"]] == ["replayed"]
    again = train_sparse_kd(tmp_path / "run", student, out, batch_size=2, epochs=2)
    assert [s["action"] for s in again["shards"]] == ["already-committed"]  # a target, not "one more"
    (shard_dir, head), = available_shards(tmp_path / "run")[1]
    events = Ledger(tmp_path / "run" / ".consumption" / f"{head.transaction_id}.jsonl", shard_dir, plan).events
    assert [e.action for e in events] == ["reserve", "commit", "replay", "commit"]
    assert events[2].replay_of == events[1].digest()


def test_student_rollout_shards_are_consume_once(tmp_path, tiny_pair):
    teacher, student = tiny_pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(2, 32), top_k=4,
                                      trajectory="student-rollout")
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run")
    from kiln.distill.errors import LedgerError

    with pytest.raises(LedgerError, match="consume-once"):
        train_sparse_kd(tmp_path / "run", student, tmp_path / "train", epochs=2)
    result = train_sparse_kd(tmp_path / "run", student, tmp_path / "train")
    assert [s["action"] for s in result["shards"]] == ["trained"]


def test_cli_train_killed_after_checkpoint_reconciles_then_replays_only_when_asked(tmp_path, tiny_pair):
    """`kiln distill train` dies (os._exit, like kill -9) between the durable checkpoint and the ledger commit.
    Rerunning it appends exactly one commit naming that checkpoint (no retraining); rerunning again trains
    nothing; only ``--epochs 2`` trains the consumed shard again, as a chained replay (replay_of = hash of
    the commit event)."""
    import os
    import subprocess
    import sys

    from typer.testing import CliRunner

    from kiln.canonical import sha256_hex
    from kiln.distill.cli import app
    from kiln.distill.faults import FAULT_ENV, FAULT_EXIT_CODE

    teacher, student = tiny_pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(2, 32), top_k=4)
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run")
    out = tmp_path / "train"
    args = ["train", str(tmp_path / "run"), "--student", str(student), "--out", str(out), "--batch-size", "1"]
    kiln = Path(sys.executable).with_name("kiln")
    proc = subprocess.run([str(kiln), "distill", *args], check=False, env=os.environ | {FAULT_ENV: "train_after_checkpoint"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == FAULT_EXIT_CODE, proc.stdout + proc.stderr
    (shard_dir, head), = available_shards(tmp_path / "run")[1]
    ledger_path = tmp_path / "run" / ".consumption" / f"{head.transaction_id}.jsonl"
    assert [e.action for e in Ledger(ledger_path, shard_dir, plan).events] == ["reserve"]
    ckpt = out / "checkpoints" / "ckpt-00001"
    ckpt_sha = sha256_hex((ckpt / "CHECKPOINT.json").read_bytes())

    def cli(*extra):
        res = CliRunner().invoke(app, [*args, *extra])
        assert res.exit_code == 0, res.stdout
        return json.loads(res.stdout)

    resumed = cli()
    assert [s["action"] for s in resumed["shards"]] == ["reconciled"] and resumed["checkpoint_sha256"] == ckpt_sha
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["ckpt-00001"]  # nothing retrained
    assert [s["action"] for s in cli()["shards"]] == ["already-committed"]
    replayed = cli("--epochs", "2")
    assert [s["action"] for s in replayed["shards"]] == ["replayed"] and replayed["steps"] == 2 * resumed["steps"]
    events = Ledger(ledger_path, shard_dir, plan).events
    assert [e.action for e in events] == ["reserve", "commit", "replay", "commit"]
    assert events[1].checkpoint_sha256 == ckpt_sha and events[2].replay_of == events[1].digest()
