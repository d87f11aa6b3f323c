"""Spec deviations round 4 (issue 44), AutoDistill v1 side. Each test quotes the clause of
shared/spec/autodistill-v1.txt it enforces and was written from those words before the fix.
Items 1-3 run end to end through ``kiln distill capture`` / ``verify`` / ``train`` subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.distill import shards

from tests.distill.tinymodels import capture_in_process, make_plan, synthetic_examples, tiny_pair  # noqa: F401

torch = pytest.importorskip("torch")


def kiln_distill(*args: str, timeout: int = 300) -> tuple[int, dict]:
    """``kiln distill ARGS`` as a real subprocess: one JSON line on stdout."""
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "distill", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    assert proc.stdout.count("\n") == 1, (proc.stdout, proc.stderr)
    return proc.returncode, json.loads(proc.stdout)


def capture_cli(plan_path: Path, teacher: Path, data: Path, out: Path, per_shard: int) -> tuple[int, dict]:
    return kiln_distill("capture", plan_path, "--teacher", teacher, "--dataset-root", data, "--out", out,
                        "--device", "cpu", "--examples-per-shard", str(per_shard))


def available_example_ids(root: Path) -> list[str]:
    """Example IDs of every intact available shard under a capture root, in shard order (duplicates kept)."""
    from kiln.distill.binary import packed_trajectories

    ids = []
    for entry in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
        verdict = shards.verify_shard(entry)
        if verdict.ok and verdict.state == "available":
            for p in shards.read_manifest_chain(entry)[-1].payloads:
                ids += [t[0] for t in packed_trajectories((entry / p.path).read_bytes(), p.path)]
    return ids


# ---- item 1 -------------------------------------------------------------------------------
# "A worker request selects a half-open example range, but the complete dataset fingerprint and
#  total planned target-token count are verified before that shard subset is accepted. Ranges
#  never split one example trajectory." / resume table: "available | valid/matching | reuse
#  without recapture", "any other state | corrupt or mismatched | quarantine and start a new
#  transaction". "Resume must never mix rows from two plans or duplicate an already committed prefix."


@pytest.mark.slow  # six Python processes with torch (~1 min on an idle 2-core machine); in-process twin below
def test_resume_with_another_shard_range_never_drops_a_planned_example(tmp_path, tiny_pair):
    """End to end: capture with 2 examples per shard, resume with 3. Every planned example must end in
    exactly one available shard and the run's tokens must equal the plan's planned_tokens."""
    teacher, student = tiny_pair
    examples = synthetic_examples(4, 32, prompt=3, target=2)
    plan_path, plan, data = make_plan(tmp_path, teacher, student, examples, top_k=4)
    assert plan.capture.planned_tokens == 8
    out = tmp_path / "run"
    rc, first = capture_cli(plan_path, teacher, data, out, 2)
    assert rc == 0 and first["tokens"] == 8, first
    rc, second = capture_cli(plan_path, teacher, data, out, 3)
    assert rc == 0, second
    assert second["tokens"] == plan.capture.planned_tokens
    assert sorted(available_example_ids(out)) == [e["example_id"] for e in examples]
    # verify agrees: the run holds every planned token once, no problem listed
    rc, verified = kiln_distill("verify", out, "--dataset-root", data)
    assert rc == 0 and verified["run"]["complete"] is True, verified["run"]
    # the only remark: the two old-range shards were quarantined (never reused, never consumed)
    assert verified["run"]["problems"] == ["2 shard(s) not counted (failed verification, staging or quarantined)"]
    notes = [s["verdict"] for s in verified["shards"] if s["verdict"]["state"] == "quarantined"]
    assert len(notes) == 2
    assert verified["run"]["bytes_per_token"]["observed_tokens"] == plan.capture.planned_tokens
    # train consumes each example exactly once
    rc, trained = kiln_distill("train", out, "--student", student, "--out", tmp_path / "train", "--batch-size", "4")
    assert rc == 0, trained
    assert trained["tokens"] == plan.capture.planned_tokens


def four_examples_captured_two_per_shard(tmp_path: Path, pair):
    """(examples, plan, dataset root, capture root, capture_with(per_shard)) after an in-process capture of
    four 2-token examples with 2 examples per shard."""
    from kiln.distill.capture import CaptureRequest, run_capture_child

    teacher, student = pair
    examples = synthetic_examples(4, 32, prompt=3, target=2)
    plan_path, plan, data = make_plan(tmp_path, teacher, student, examples, top_k=4)
    out = tmp_path / "run"

    def capture_with(per_shard: int) -> dict:
        return run_capture_child(CaptureRequest(plan=str(plan_path), teacher=str(teacher), tokenizer=str(teacher),
                                                dataset_root=str(data), out=str(out), device="cpu",
                                                examples_per_shard=per_shard))

    capture_with(2)
    return examples, plan, data, out, capture_with


def test_resume_with_another_shard_range_in_process(tmp_path, tiny_pair):
    """The same scenario in this process (default lane): the second run ends with every planned
    example in exactly one available shard, and the old-range shards quarantined."""
    from kiln.distill.shards import check_run_complete

    examples, plan, _data, out, capture_with = four_examples_captured_two_per_shard(tmp_path, tiny_pair)
    second = capture_with(3)
    assert [s["decision"] for s in second["shards"]] == ["quarantine-and-restart"] * 2
    assert sorted(available_example_ids(out)) == [e["example_id"] for e in examples]
    verdicts = check_run_complete(out, plan)
    assert sum(v.tokens for v in verdicts) == plan.capture.planned_tokens


def test_an_available_shard_holding_another_range_is_not_reused(tmp_path, tiny_pair):
    """"available | valid/matching | reuse": a shard whose examples are not exactly its range in this run
    does not match; its verdict names the range (item 10: not "not in the plan's dataset")."""
    from kiln.distill.capture import load_examples

    _examples, plan, data, out, _capture_with = four_examples_captured_two_per_shard(tmp_path, tiny_pair)
    dataset = {e.example_id: e for e in load_examples(data, plan)}
    shard0 = out / "shard-00000.t000"
    # this run's range for shard-00000 is ex-0000..ex-0002: the shard holds only two of them
    verdict = shards.verify_shard(shard0, examples=dataset, shard_range=["ex-0000", "ex-0001", "ex-0002"])
    assert not verdict.ok and verdict.decision == "quarantine-and-restart"
    assert "range" in " ".join(verdict.problems)
    shard1 = out / "shard-00001.t000"
    verdict = shards.verify_shard(shard1, examples=dataset, shard_range=["ex-0003"])
    text = " ".join(verdict.problems)
    assert not verdict.ok and "ex-0002" in text and "not in the plan's dataset" not in text
    assert "outside" in text
    # the exact range still reuses
    assert shards.verify_shard(shard0, examples=dataset, shard_range=["ex-0000", "ex-0001"]).decision == "reuse"


# ---- item 3 -------------------------------------------------------------------------------
# Threat model: "Duplicate/reordered records | Contiguous IDs/positions and committed counts | Fail
#  closed; resume verified prefix only". "Resume must never ... duplicate an already committed prefix."


def duplicate_shard(root: Path, plan, source: Path, shard_id: str) -> Path:
    """Publish, through the write-last protocol, a second shard holding the same example rows."""
    txn = shards.begin(root, plan, shard_id, f"{shard_id}.t000")
    for p in shards.read_manifest_chain(source)[-1].payloads:
        shards.write_payload_bytes(txn, p.path.split("/")[-1], (source / p.path).read_bytes())
    shards.mark_complete(txn)
    shards.mark_verified(txn)
    return shards.publish(txn, root)


def test_two_available_shards_holding_one_example_fail_verify_and_train(tmp_path, tiny_pair):
    teacher, student = tiny_pair
    examples = synthetic_examples(3, 32, prompt=3, target=2)
    plan_path, plan, data = make_plan(tmp_path, teacher, student, examples, top_k=4)
    out = tmp_path / "run"
    capture_in_process(tmp_path, teacher, plan_path, data, out, examples_per_shard=2)
    duplicate_shard(out, plan, out / "shard-00001.t000", "shard-00002")
    rc, verified = kiln_distill("verify", out)
    assert rc == 0
    problems = " ".join(verified["run"]["problems"])
    assert "ex-0002" in problems and "shard-00001.t000" in problems and "shard-00002.t000" in problems
    assert "planned_tokens" in problems  # 8 observed tokens against 6 planned
    assert verified["run"]["complete"] is False
    # training fails closed before any consumption
    rc, refused = kiln_distill("train", out, "--student", student, "--out", tmp_path / "train")
    assert rc == 2 and "ex-0002" in refused["error"]["message"], refused
    assert not (out / ".consumption").exists() and not (tmp_path / "train" / "ledgers").exists()


# ---- item 2 -------------------------------------------------------------------------------
# "Consumption is an append-only ledger over an immutable source artifact." / "Student-rollout
#  trajectories are one-round, consume-once signals. Replay after commit is forbidden because the
#  prefixes are stale with respect to the updated student." / threat model: "Stale student on-policy
#  prefixes | Student rollout already committed/round changed | Forbid replay; recapture from the new
#  student".


def ledger_events(root: Path) -> dict[str, list[str]]:
    base = root / ".consumption"
    return {p.stem: [json.loads(line)["next_state"] for line in p.read_text().splitlines()]
            for p in sorted(base.glob("*.jsonl"))}


@pytest.mark.slow  # eight Python processes with torch; in-process twin below
def test_a_committed_student_rollout_shard_is_never_consumed_again(tmp_path, tiny_pair):
    """End to end: one capture, trainers in two output folders, then the same rows recaptured as .t001.
    Only the first consumption commits; the others refuse and append nothing."""
    teacher, student = tiny_pair
    examples = synthetic_examples(2, 32, prompt=3, target=2)
    plan_path, plan, data = make_plan(tmp_path, teacher, student, examples, top_k=4, trajectory="student-rollout")
    out = tmp_path / "run"
    rc, _ = capture_cli(plan_path, teacher, data, out, 2)
    assert rc == 0
    rc, first = kiln_distill("train", out, "--student", student, "--out", tmp_path / "a", "--batch-size", "4")
    assert rc == 0 and [s["action"] for s in first["shards"]] == ["trained"], first
    assert ledger_events(out) == {"shard-00000.t000": ["reserved", "committed"]}
    # another training folder: the artifact's ledger is the same one, so there is nothing to consume
    rc, second = kiln_distill("train", out, "--student", student, "--out", tmp_path / "b")
    assert rc == 2 and "already consumed" in second["error"]["message"], second
    assert ledger_events(out) == {"shard-00000.t000": ["reserved", "committed"]}
    # the same rows recaptured under a new transaction: the rows, not the transaction, were consumed
    shards.quarantine(out / "shard-00000.t000", "operator re-check")
    rc, again = capture_cli(plan_path, teacher, data, out, 2)
    assert rc == 0 and [s["transaction_id"] for s in again["shards"]] == ["shard-00000.t001"], again
    rc, third = kiln_distill("train", out, "--student", student, "--out", tmp_path / "c")
    assert rc == 2, third
    assert "ex-0000" in third["error"]["message"] and "shard-00000.t000" in third["error"]["message"]
    assert ledger_events(out) == {"shard-00000.t000": ["reserved", "committed"]}
    rc, status = kiln_distill("status", out)
    assert rc == 0 and [(x["transaction_id"], x["state"]) for x in status["ledgers"]] == [
        ("shard-00000.t000", "committed")]


def committed_rollout_capture(tmp_path: Path, pair, n_examples: int):
    """A student-rollout capture (one shard) whose artifact ledger holds one reserve and one commit."""
    from kiln.distill.consumption import artifact_ledger

    teacher, student = pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(n_examples, 32, prompt=3,
                                                                                     target=2),
                                      top_k=4, trajectory="student-rollout")
    out = tmp_path / "run"
    capture_in_process(tmp_path, teacher, plan_path, data, out)
    t000 = out / "shard-00000.t000"
    ledger = artifact_ledger(out, t000, plan, t000.name)
    ledger.reserve("trainer-a", "a.r0")
    ledger.commit("cd" * 32)
    return plan_path, plan, data, out, ledger


def test_rows_recaptured_under_a_new_transaction_are_not_consumed_again(tmp_path, tiny_pair):
    """In-process twin of the CLI test above (default lane): t000 committed, quarantined, the same rows
    recaptured as t001; reserving t001 is refused, naming the rows and t000."""
    from kiln.distill.consumption import artifact_ledger
    from kiln.distill.errors import LedgerError

    teacher, _student = tiny_pair
    plan_path, plan, data, out, ledger = committed_rollout_capture(tmp_path, tiny_pair, 2)
    t000 = out / "shard-00000.t000"
    shards.quarantine(t000, "operator re-check")
    receipt = capture_in_process(tmp_path, teacher, plan_path, data, out)
    assert [s["transaction_id"] for s in receipt["shards"]] == ["shard-00000.t001"]
    t001 = out / "shard-00000.t001"
    fresh = artifact_ledger(out, t001, plan, t001.name)
    with pytest.raises(LedgerError, match="ex-0000") as err:
        fresh.reserve("trainer-b", "b.r0")
    assert "shard-00000.t000" in str(err.value)
    assert ledger_events(out) == {"shard-00000.t000": ["reserved", "committed"]}


def test_the_ledger_of_an_artifact_is_the_same_file_for_every_consumer(tmp_path, tiny_pair):
    """Two ledgers opened for one artifact (e.g. two trainers) see each other's events: the second
    plain reservation of a committed rollout shard is refused."""
    from kiln.distill.consumption import artifact_ledger
    from kiln.distill.errors import DistillError

    _plan_path, plan, _data, out, _one = committed_rollout_capture(tmp_path, tiny_pair, 1)
    shard = out / "shard-00000.t000"
    two = artifact_ledger(out, shard, plan, shard.name)
    assert two.view.commits == 1
    with pytest.raises(DistillError, match="replay"):  # committed -> reserved is only a (forbidden) replay
        two.reserve("trainer-b", "b.r0")
    with pytest.raises(DistillError, match="consume-once"):
        two.replay("trainer-b", "b.r1")


# ---- item 4 -------------------------------------------------------------------------------
# "Every source byte, normalized row, tokenizer file, teacher config, and listed teacher weight is
#  verified before model load." / "The plan binds all inputs that can alter captured bytes: teacher
#  ... config.json hashes, and the sorted weight-file path/size/hash list"


def test_remote_capture_refuses_weight_files_that_do_not_digest_to_the_served_model(tmp_path, tiny_pair):
    """A remote teacher serving base_model_sha256 = the plan's revision, but the plan's weight_files are
    another model's: the digest computable from the listed weights differs, so capture must refuse."""
    import kiln
    from kiln.canonical import base_model_digest
    from kiln.distill.contract import complete_plan
    from kiln.distill.errors import ContractError
    from kiln.distill.local import model_fingerprint
    from kiln.distill.remote import RemoteTeacherScorer
    from kiln.teachers.identity import TeacherIdentityV1

    teacher, student = tiny_pair
    _p, plan, _d = make_plan(tmp_path, teacher, student, synthetic_examples(1, 32), top_k=4,
                             backend="remote-kiln", backend_version=f"kiln:{kiln.__version__}")
    cfg = plan.to_obj()
    cfg.pop("estimate")
    cfg["teacher"]["weight_files"] = model_fingerprint(student).to_obj()["weight_files"]  # another model's files
    lying = complete_plan(cfg)
    assert lying.teacher.revision == plan.teacher.revision
    listed = base_model_digest((f.sha256, f.size) for f in lying.teacher.weight_files)
    assert listed != lying.teacher.revision  # what the spec's words make checkable

    ident, manifest = _kiln_teacher(plan.teacher.revision, plan.teacher.config_sha256)
    spec = {"alias": "t", "provider": "kiln", "fingerprint": ident.fingerprint(), "url": "http://127.0.0.1:9",
            "model_id": "teacher", "credential": None, "credential_id": None, "manifest": manifest}
    with pytest.raises(ContractError, match="weight_files"):
        RemoteTeacherScorer(lying, spec, str(teacher))
    # the honest plan passes this check (and fails later only on the made-up tokenizer digest)
    with pytest.raises(ContractError, match="tokenizer_vocab_sha256"):
        RemoteTeacherScorer(plan, spec, str(teacher))


def _kiln_teacher(revision: str, config_sha256: str):
    """A Kiln teacher identity whose inference document binds ``config_sha256``, and its teacher manifest."""
    import kiln
    from kiln.canonical import canonical_json_bytes, domain_digest
    from kiln.teachers.identity import TeacherIdentityV1
    from kiln.teachers.kiln_identity import KILN_INFERENCE_DOMAIN

    doc = {"schema": "kiln.kiln-teacher-inference.v1", "model_config_sha256": config_sha256, "dtype": "float32"}
    ident = TeacherIdentityV1(
        served_model_id="teacher", base_model_sha256=revision, tokenizer_vocab_sha256="a" * 64,
        tokenizer_config_sha256="b" * 64, adapter=None, vocab_size=32, max_top_k=32, max_model_len=128,
        max_prompt_logprob_candidates=32 * 128, implementation=f"kiln:{kiln.__version__}",
        inference_config_sha256=domain_digest(KILN_INFERENCE_DOMAIN, canonical_json_bytes(doc)))
    return ident, {"system_fingerprint": ident.fingerprint(), "inference_config": doc}


def test_remote_capture_verifies_the_teacher_config_through_its_manifest(tmp_path, tiny_pair):
    """The plan lists the teacher's config.json hash; the fingerprint binds the config only inside
    inference_config_sha256, so the capture needs the teacher manifest (the inference document) to verify
    it: a plan naming another config, no manifest, an edited manifest or another teacher's are refused."""
    import kiln
    from kiln.distill.contract import complete_plan
    from kiln.distill.errors import ContractError
    from kiln.distill.remote import RemoteTeacherScorer

    teacher, student = tiny_pair
    _p, plan, _d = make_plan(tmp_path, teacher, student, synthetic_examples(1, 32), top_k=4,
                             backend="remote-kiln", backend_version=f"kiln:{kiln.__version__}")
    ident, manifest = _kiln_teacher(plan.teacher.revision, plan.teacher.config_sha256)
    spec = {"alias": "t", "provider": "kiln", "fingerprint": ident.fingerprint(), "url": "http://127.0.0.1:9",
            "model_id": "teacher", "credential": None, "credential_id": None}
    cfg = plan.to_obj()
    cfg.pop("estimate")
    cfg["teacher"]["config_sha256"] = "d" * 64  # another model's config.json
    other = complete_plan(cfg)
    with pytest.raises(ContractError, match="teacher.config_sha256: plan d{64}, the teacher serves config.json"):
        RemoteTeacherScorer(other, spec | {"manifest": manifest}, str(teacher))
    with pytest.raises(ContractError, match="--teacher-manifest"):
        RemoteTeacherScorer(plan, spec, str(teacher))
    edited = manifest | {"inference_config": manifest["inference_config"] | {"model_config_sha256": "d" * 64}}
    with pytest.raises(ContractError, match="inference_config digests to"):
        RemoteTeacherScorer(other, spec | {"manifest": edited}, str(teacher))
    stranger, their_manifest = _kiln_teacher("e" * 64, plan.teacher.config_sha256)
    with pytest.raises(ContractError, match="another teacher"):
        RemoteTeacherScorer(plan, spec | {"manifest": their_manifest}, str(teacher))
    with pytest.raises(ContractError, match="tokenizer_vocab_sha256"):  # the config is proven: later checks run
        RemoteTeacherScorer(plan, spec | {"manifest": manifest}, str(teacher))


# ---- item 6 -------------------------------------------------------------------------------
# "The worker also verifies the loaded floating-parameter dtypes against capture.dtype. An
#  unquantized checkpoint must expose exactly that dtype" / "The declared inference dtype, all
#  observed floating-parameter dtypes, and the quantization identity are repeated in the child receipt."


def _plan_with(plan, **capture):
    from kiln.distill.contract import complete_plan

    cfg = plan.to_obj()
    cfg.pop("estimate")
    cfg["capture"].update(capture)
    return complete_plan(cfg)


def test_an_all_float32_checkpoint_does_not_capture_under_a_bfloat16_plan(tmp_path, tiny_pair):
    from kiln.distill.capture import LocalTeacherScorer
    from kiln.distill.errors import ContractError

    teacher, student = tiny_pair
    _p, plan, _d = make_plan(tmp_path, teacher, student, synthetic_examples(1, 32), top_k=4)
    with pytest.raises(ContractError, match="float32"):
        LocalTeacherScorer(_plan_with(plan, dtype="bfloat16"), teacher, device="cpu")
    scorer = LocalTeacherScorer(plan, teacher, device="cpu")  # the checkpoint's own dtype passes
    assert scorer.receipt()["observed_dtypes"] == ["float32"]


# ---- item 7 -------------------------------------------------------------------------------
# "capture.backend_version is the exact installed mlx-lm distribution version and the tokenizer
#  renderer is mlx-lm@<version>. Both must match the plan before publication." (Kiln's worker renders
#  with transformers: its renderer is transformers@<installed version>.)


def test_a_plan_naming_another_renderer_captures_nothing(tmp_path, tiny_pair):
    from kiln.distill.contract import complete_plan
    from kiln.distill.errors import ContractError

    teacher, student = tiny_pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(1, 32), top_k=4)
    cfg = plan.to_obj()
    cfg.pop("estimate")
    cfg["tokenizer"].update(renderer_name="mlx-lm", renderer_version="0.0.1")
    other = tmp_path / "other"
    other.mkdir()
    (other / "plan.json").write_bytes(complete_plan(cfg).canonical_bytes())
    with pytest.raises(ContractError, match="mlx-lm@0.0.1"):
        capture_in_process(tmp_path, teacher, other / "plan.json", data, tmp_path / "run")
    assert not (tmp_path / "run").exists() or not [p for p in (tmp_path / "run").iterdir()]
