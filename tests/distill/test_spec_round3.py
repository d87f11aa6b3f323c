"""Spec deviations round 3 (issue 33), AutoDistill v1 side. Each test quotes the clause of
shared/spec/autodistill-v1.txt it enforces; the expected values come from the spec's words
(hashlib over canonical bytes computed here), not from Kiln's own digest functions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kiln.distill.contract import CaptureTokenRow, Plan, ThroughputProfile, complete_plan
from kiln.distill.errors import ContractError
from tests.distill.conftest import FIXTURES
from tests.distill.tinymodels import tiny_pair  # noqa: F401  (fixture)


def c14n(obj) -> bytes:
    """The spec's canonical JSON, written out here: UTF-8, sorted keys, no insignificant whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plan_text_with_temperature(literal: str) -> bytes:
    """The committed fixture plan with ``temperature`` spelled ``literal`` in the file."""
    raw = (FIXTURES / "plan.json").read_bytes()
    assert b'"temperature":1.0' in raw
    return raw.replace(b'"temperature":1.0', b'"temperature":' + literal.encode())


# ---- item 2 -------------------------------------------------------------------------------
# "Canonical JSON is UTF-8, sorted by key, has no insignificant whitespace, permits no
#  NaN/Infinity values, and is hashed with SHA-256." / "The SHA-256 of the plan's canonical
#  JSON is the plan_sha256 embedded in every shard."


@pytest.mark.parametrize("literal", ["1", "1.0", "1e0", "1.00", "10e-1", "0.5", "2"])
def test_plan_sha256_is_sha256_of_the_received_documents_canonical_bytes(literal):
    raw = plan_text_with_temperature(literal)
    plan = Plan.parse(raw)
    assert plan.digest() == sha(c14n(json.loads(raw)))
    # and the bytes Kiln writes for it are exactly those canonical bytes
    assert plan.canonical_bytes() == c14n(json.loads(raw))


def test_number_forms_1_and_1_0_are_distinct_runs_and_1_0_equals_1e0():
    """docs/distill.md "Numbers": an integer literal stays an integer; 1.0, 1e0 and 1.00 are one double."""
    d = {lit: Plan.parse(plan_text_with_temperature(lit)).digest() for lit in ("1", "1.0", "1e0", "1.00")}
    assert d["1.0"] == d["1e0"] == d["1.00"]
    assert d["1"] != d["1.0"]


def test_integer_rate_throughput_profile_hashed_as_sha256_of_its_c14n_is_accepted():
    """"an optional previously measured throughput profile and its hash": the hash a producer computes
    over the profile's canonical JSON (integer rates as integers) must be accepted."""
    base = json.loads((FIXTURES / "plan.json").read_bytes())
    teacher_sha = sha(c14n(base["teacher"]))
    profile = {
        "backend": "fixture", "teacher_fingerprint_sha256": teacher_sha, "dtype": "float32", "quantization": "none",
        "sequence_length_min": 1, "sequence_length_max": 64, "hardware_class": "cpu-test",
        "tokens_per_second_min": 100, "tokens_per_second_max": 400,
    }
    cfg = dict(base)
    cfg.pop("estimate")
    cfg["throughput_profile"] = profile
    cfg["throughput_profile_sha256"] = sha(c14n(profile))
    plan = complete_plan(cfg)
    assert plan.throughput_profile_sha256 == sha(c14n(profile))
    assert plan.estimate.seconds_min == 2 / 400 and plan.estimate.seconds_max == 2 / 100
    # The written plan is the canonical form of what was given plus the derived estimate.
    written = json.loads(plan.canonical_bytes())
    assert written["throughput_profile"] == profile
    assert c14n(written["throughput_profile"]) == c14n(profile)
    assert plan.digest() == sha(c14n(written))


def test_profile_hash_over_a_re_serialised_float_form_is_refused():
    """The hash binds the profile as given: 100 and 100.0 are different canonical bytes."""
    base = json.loads((FIXTURES / "plan.json").read_bytes())
    profile = {
        "backend": "fixture", "teacher_fingerprint_sha256": sha(c14n(base["teacher"])), "dtype": "float32",
        "quantization": "none", "sequence_length_min": 1, "sequence_length_max": 64, "hardware_class": "cpu-test",
        "tokens_per_second_min": 100, "tokens_per_second_max": 400,
    }
    floated = {**profile, "tokens_per_second_min": 100.0, "tokens_per_second_max": 400.0}
    cfg = dict(base)
    cfg.pop("estimate")
    cfg["throughput_profile"] = profile
    cfg["throughput_profile_sha256"] = sha(c14n(floated))
    with pytest.raises(ContractError, match="throughput_profile_sha256"):
        complete_plan(cfg)
    assert ThroughputProfile.parse(profile).digest() == sha(c14n(profile))


@pytest.mark.parametrize("literal", ["0", "-1", "true", "9007199254740993"])
def test_temperature_still_refuses_non_positive_bool_and_inexact_integers(literal):
    with pytest.raises(ContractError):
        Plan.parse(plan_text_with_temperature(literal))


def test_capture_rows_keep_integer_numbers_so_their_canonical_bytes_are_the_received_ones():
    line = (FIXTURES / "rows-teacher-expert.jsonl").read_bytes().split(b"\n")[0]
    obj = json.loads(line)
    obj["temperature"] = 1
    row = CaptureTokenRow.parse(c14n(obj))
    assert row.canonical_bytes() == c14n(obj)


def test_kiln_distill_plan_prints_the_sha256_of_the_file_it_wrote(tmp_path: Path, monkeypatch, capsys):
    from typer.testing import CliRunner

    from kiln.distill.cli import app

    cfg = json.loads(plan_text_with_temperature("1"))
    cfg.pop("estimate")
    (tmp_path / "cfg.json").write_text(json.dumps(cfg, indent=2))
    res = CliRunner().invoke(app, ["plan", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    written = (tmp_path / "run" / "plan.json").read_bytes()
    assert out["plan_sha256"] == sha(written) == sha(c14n(json.loads(written)))
    assert json.loads(written)["probability"]["temperature"] == 1 and b'"temperature":1,' in written


# ---- item A and item 7 ----------------------------------------------------------------------
# Threat model: "Mixed run/model/tokenizer/data | Plan and immutable fingerprint mismatch |
#  Refuse resume/consumption and create a new run"; a refusal writes nothing.
# Estimate: "Actual output must report both planned and observed bytes/token."


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_capturing_a_foreign_plan_into_another_runs_out_writes_nothing(tmp_path, tiny_pair):
    pytest.importorskip("torch")
    from kiln.distill.capture import CaptureRequest, capture, run_capture_child
    from kiln.distill.errors import ShardError
    from tests.distill.tinymodels import make_plan, synthetic_examples

    teacher, student = tiny_pair
    examples = synthetic_examples(2, 32, prompt=3, target=3)
    plan_a_path, plan_a, data = make_plan(tmp_path / "a", teacher, student, examples, top_k=4)
    plan_b_path, plan_b, _ = make_plan(tmp_path / "b", teacher, student, examples, top_k=2)
    assert plan_a.digest() != plan_b.digest()
    out = tmp_path / "run"
    req_a = CaptureRequest(plan=str(plan_a_path), teacher=str(teacher), tokenizer=str(teacher),
                           dataset_root=str(data), out=str(out), device="cpu", examples_per_shard=1)
    receipt = capture(req_a, timeout=300)

    before = _tree(out)
    req_b = CaptureRequest(plan=str(plan_b_path), teacher=str(teacher), tokenizer=str(teacher),
                           dataset_root=str(data), out=str(out), device="cpu", examples_per_shard=1)
    with pytest.raises(ShardError, match="another plan"):
        capture(req_b, timeout=300)
    with pytest.raises(ShardError, match="another plan"):
        run_capture_child(req_b)  # the child refuses on its own too, before any write
    assert _tree(out) == before
    final = json.loads((out / ".receipts" / "capture.json").read_bytes())
    child = (out / ".receipts" / "capture-child.json").read_bytes()
    assert final["child_receipt_sha256"] == sha(child)

    # item 7: planned (from the spec's formulas, written out here) and observed bytes/token
    prob, v, n = plan_a.probability, plan_a.tokenizer.vocab_size, plan_a.capture.planned_tokens
    s_max = min(v, prob.top_k + plan_a.capture.max_forced_ids)
    bpt = receipt["bytes_per_token"]
    assert bpt["planned_sparse_upper"] == s_max * (prob.id_bytes + prob.logprob_bytes) + prob.tail_bytes + prob.entropy_bytes
    assert bpt["planned_dense"] == v * prob.logprob_bytes and bpt["planned_excludes_metadata"] is True
    payload = sum(p.stat().st_size for p in out.rglob("*.kdpack"))
    assert bpt["observed_bytes"] == payload and bpt["observed_tokens"] == n == 6
    assert bpt["observed"] == payload / n
    for shard in receipt["shards"]:
        assert shard["bytes_per_token"]["observed"] == shard["payload_bytes"] / shard["tokens"]
    assert json.loads((out / ".receipts" / "capture.json").read_bytes())["bytes_per_token"] == bpt


def test_foreign_receipts_alone_make_the_root_another_runs(tmp_path, expert_plan):
    from kiln.distill.capture import RECEIPTS_DIR, refuse_foreign_root
    from kiln.distill.errors import ShardError

    out = tmp_path / "run"
    (out / RECEIPTS_DIR).mkdir(parents=True)
    (out / RECEIPTS_DIR / "capture.json").write_bytes(c14n({"plan_sha256": "0" * 64}))
    with pytest.raises(ShardError, match="another plan"):
        refuse_foreign_root(out, expert_plan)
    (out / RECEIPTS_DIR / "capture.json").write_bytes(c14n({"plan_sha256": expert_plan.digest()}))
    refuse_foreign_root(out, expert_plan)


# ---- item 4 -------------------------------------------------------------------------------
# Threat model: "Path traversal/symlink swap | ... no-follow reads | Refuse access"; the same
# non-blocking regular-file rule the launcher applies: a FIFO is not a file to read.


def _distill(*args: str, timeout: int = 120) -> tuple[int, dict]:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "distill", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.stdout.count("\n") == 1, proc.stdout + proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_fifo_inputs_are_refused_without_blocking(tmp_path, shard_copy):
    import os
    import shutil

    fifo = tmp_path / "input.fifo"
    os.mkfifo(fifo)
    rc, out = _distill("c14n", str(fifo))
    assert rc == 2 and "regular file" in out["error"]["message"]
    rc, out = _distill("plan", "--config", str(fifo), "--out", str(tmp_path / "run"))
    assert rc == 2 and "regular file" in out["error"]["message"]
    assert not (tmp_path / "run" / "plan.json").exists()

    # an existing --out/plan.json that is a FIFO
    (tmp_path / "run2").mkdir()
    os.mkfifo(tmp_path / "run2" / "plan.json")
    cfg = json.loads((FIXTURES / "plan.json").read_bytes())
    cfg.pop("estimate")
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    rc, out = _distill("plan", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "run2"))
    assert rc == 2 and "regular file" in out["error"]["message"]

    # a shard whose plan.json is a FIFO: verify reports it, and finishes
    (shard_copy / "plan.json").unlink()
    os.mkfifo(shard_copy / "plan.json")
    rc, out = _distill("verify", str(shard_copy))
    assert rc == 0
    verdict = out["shards"][0]["verdict"]
    assert verdict["ok"] is False and any("regular file" in p for p in verdict["problems"])
    shutil.rmtree(shard_copy)


def test_capture_with_a_fifo_plan_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    (tmp_path / "data").mkdir()
    (tmp_path / "teacher").mkdir()
    rc, out = _distill("capture", str(fifo), "--teacher", str(tmp_path / "teacher"), "--dataset-root",
                       str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--device", "cpu")
    assert rc == 2 and "regular file" in out["error"]["message"]


# ---- item 9 -------------------------------------------------------------------------------
# "A worker request selects a half-open example range, but the complete dataset fingerprint and
#  total planned target-token count are verified before that shard subset is accepted. Ranges
#  never split one example trajectory." / publication step 5: "Reopen every payload, verify ...
#  plan hash, and tokenizer/data fingerprints."


def _dataset(plan) -> dict:
    from kiln.distill.capture import load_examples

    return {e.example_id: e for e in load_examples(FIXTURES, plan)}


def _renamed(rows, example_id):
    return [r.model_copy(update={"example_id": example_id}) for r in rows]


def _recontexted(rows, first_context):
    out, ctx = [], tuple(first_context)
    for r in rows:
        out.append(r.model_copy(update={"context_token_ids": ctx}))
        ctx = ctx + (r.forced_token_id,)
    return out


def test_rows_of_the_dataset_publish(tmp_path, expert_plan, expert_rows):
    from kiln.distill import shards

    final = shards.capture_shard(tmp_path, expert_plan, "s0", "s0.t000", {"rows-00000.jsonl": expert_rows},
                                 examples=_dataset(expert_plan))
    assert shards.verify_shard(final, examples=_dataset(expert_plan)).ok


@pytest.mark.parametrize(
    "case,match",
    [("absent example", "not in the plan's dataset"), ("contradicting context", "contradicts the dataset prompt"),
     ("missing position", "not the dataset's target_token_ids")],
)
def test_rows_that_contradict_the_dataset_never_complete(tmp_path, expert_plan, expert_rows, case, match):
    from kiln.distill import shards
    from kiln.distill.errors import ShardError

    rows = {
        "absent example": lambda: _renamed(expert_rows, "ex-999"),
        "contradicting context": lambda: _recontexted(expert_rows, (2, 2)),
        "missing position": lambda: expert_rows[:1],
    }[case]()
    with pytest.raises(ShardError, match=match):
        shards.capture_shard(tmp_path, expert_plan, "s0", "s0.t000", {"rows-00000.jsonl": rows},
                             examples=_dataset(expert_plan))
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # nothing published


def test_one_example_split_across_two_jsonl_payloads_is_refused_like_packed(tmp_path, expert_plan, expert_rows):
    from kiln.distill import shards
    from kiln.distill.errors import ShardError

    with pytest.raises(ShardError, match="never split"):
        shards.capture_shard(tmp_path, expert_plan, "s0", "s0.t000",
                             {"rows-00000.jsonl": expert_rows[:1], "rows-00001.jsonl": expert_rows[1:]})


def test_verify_with_the_dataset_reports_a_shard_whose_rows_are_not_dataset_examples(tmp_path, expert_plan,
                                                                                     expert_rows):
    from typer.testing import CliRunner

    from kiln.distill import shards
    from kiln.distill.cli import app

    # Published through the low-level API without a dataset (it cannot know one) ...
    final = shards.capture_shard(tmp_path, expert_plan, "s0", "s0.t000",
                                 {"rows-00000.jsonl": _recontexted(expert_rows, (0, 0))})
    assert shards.verify_shard(final).ok
    # ... verify against the dataset finds it.
    res = CliRunner().invoke(app, ["verify", str(final), "--dataset-root", str(FIXTURES)])
    assert res.exit_code == 0, res.output
    verdict = json.loads(res.output)["shards"][0]["verdict"]
    assert verdict["ok"] is False and any("contradicts the dataset prompt" in p for p in verdict["problems"])
    good = CliRunner().invoke(app, ["verify", str(FIXTURES / "shard-teacher-expert"), "--dataset-root",
                                    str(FIXTURES)])
    assert json.loads(good.output)["shards"][0]["verdict"]["ok"] is True
