"""Packed binary layout soup.autodistill.capture-packed.v1: exact row semantics,
shared manifest/verification, and bytes/token against the plan's estimate."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.canonical import sha256_hex
from kiln.distill import binary, shards
from kiln.distill.contract import complete_plan
from kiln.distill.errors import ShardError

from tests.distill.conftest import FIXTURES, read_rows
from tests.distill.tinymodels import (  # noqa: F401  (fixture)
    build_tiny_model,
    capture_in_process,
    make_plan,
    synthetic_examples,
    tiny_pair,
)


def _fixture_plan(widths: int = 8):
    obj = json.loads((FIXTURES / "plan.json").read_bytes())
    obj.pop("estimate")
    obj["probability"].update(id_bytes=4, logprob_bytes=widths, tail_bytes=widths, entropy_bytes=widths)
    return complete_plan(obj)


def _packed_example(rows):
    top, flp = [], []
    for r in rows:
        lp = dict(zip(r.selected_ids, r.selected_logprobs))
        top.append([lp[i] for i in r.top_k_ids])
        flp.append(math.nan if r.forced_token_id in r.top_k_ids else lp[r.forced_token_id])
    return binary.PackedExample(
        example_id=rows[0].example_id, context=list(rows[0].context_token_ids),
        forced=[r.forced_token_id for r in rows], top_ids=[list(r.top_k_ids) for r in rows],
        top_logprobs=top, forced_logprobs=flp, tail=[r.tail_mass for r in rows], entropy=[r.entropy for r in rows],
    )


def test_packed_round_trip_is_exactly_the_v1_rows():
    plan = _fixture_plan(8)
    rows = read_rows("rows-teacher-expert.jsonl")
    data = binary.encode_packed(plan, [_packed_example(rows)])
    header, decoded = binary.decode_packed_rows(data, "p.kdpack")
    assert decoded == rows  # float64 widths: every field, bit for bit
    assert header["records"] == 2 and header["examples"] == 1
    # Exact size: header + example header + per token (K+1)(B_id+B_logp)+B_tail+B_ent (F = 1, K < V).
    per_token = plan.estimate.sparse_upper_bytes // plan.capture.planned_tokens
    fixed = len(data) - 2 * per_token
    assert fixed == 8 + 4 + len(binary.canonical_json_bytes(header)) + 4 + len(b"ex-1") + 8 + 2 * 4


def test_packed_shard_publishes_and_verifies_with_the_same_manifest(tmp_path):
    plan = _fixture_plan(4)
    rows = read_rows("rows-teacher-expert.jsonl")
    txn = shards.begin(tmp_path, plan, "s0", "t0")
    shards.write_payload_bytes(txn, "rows-00000.kdpack", binary.encode_packed(plan, [_packed_example(rows)]))
    complete = shards.mark_complete(txn)
    assert (complete.rows, complete.tokens) == (1, 2)  # rows = example trajectories, tokens = positions
    shards.mark_verified(txn)
    final = shards.publish(txn, tmp_path)
    verdict = shards.verify_shard(final, expected_plan_sha256=plan.digest())
    assert verdict.ok and verdict.decision == "reuse", verdict.problems
    bpt = shards.bytes_per_token(verdict)
    assert bpt["planned_sparse_upper"] == 24 and bpt["observed_tokens"] == 2
    # A flipped byte is caught by the commitment, like any payload.
    p = final / "payload" / "rows-00000.kdpack"
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x40
    p.write_bytes(bytes(raw))
    bad = shards.verify_shard(final)
    assert not bad.ok and bad.decision == "quarantine-and-restart"


def test_packed_header_must_match_the_plan_and_truncation_is_refused():
    plan, other = _fixture_plan(4), _fixture_plan(8)
    rows = read_rows("rows-teacher-expert.jsonl")
    data = binary.encode_packed(other, [_packed_example(rows)])
    with pytest.raises(ShardError, match="differs from the plan"):
        shards.parse_any_payload(data, "x.kdpack", plan)
    with pytest.raises(ShardError, match="truncated"):
        binary.decode_packed_rows(data[:-5], "x.kdpack")
    with pytest.raises(ShardError, match="magic"):
        binary.decode_packed_rows(b"X" + data[1:], "x.kdpack")


def test_packed_refuses_float16_widths():
    obj = json.loads((FIXTURES / "plan.json").read_bytes())
    obj.pop("estimate")
    obj["probability"]["logprob_bytes"] = 2
    with pytest.raises(ShardError, match="float32"):
        binary.check_packable(complete_plan(obj))


def test_packed_bytes_per_token_within_5_percent_of_sparse_upper(tmp_path):
    vocab, k = 256, 32
    teacher = build_tiny_model(tmp_path / "t", vocab=vocab, seed=0)
    examples = synthetic_examples(4, vocab, prompt=8, target=120)
    plan_path, plan, data_root = make_plan(tmp_path, teacher, teacher, examples, top_k=k, max_len=256)
    out = tmp_path / "run"
    capture_in_process(tmp_path, teacher, plan_path, data_root, out, examples_per_shard=4, examples_per_payload=4)
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "distill", "verify", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(proc.stdout)["run"]
    bpt = run["bytes_per_token"]
    planned = bpt["planned_sparse_upper"]
    assert planned == (k + 1) * 8 + 8
    assert planned <= bpt["observed"] <= planned * 1.05, bpt
    assert bpt["observed"] < bpt["planned_dense"]


def _tamper(plan, field, value):
    rows = read_rows("rows-teacher-expert.jsonl")
    ex = _packed_example(rows)
    cols = {"tail": list(ex.tail), "entropy": list(ex.entropy), "forced_logprobs": list(ex.forced_logprobs),
            "top_ids": [list(x) for x in ex.top_ids], "top_logprobs": [list(x) for x in ex.top_logprobs]}
    if field in ("top_ids", "top_logprobs"):
        cols[field][0][0] = value
    else:
        cols[field][0] = value
    for name, col in cols.items():
        setattr(ex, name, col)
    return binary.encode_packed(plan, [ex])


@pytest.mark.parametrize("field,value,match", [
    ("tail", 0.3, "tail"),
    ("entropy", 5.0, "entropy"),
    ("entropy", float("nan"), "finite|entropy"),
    ("forced_logprobs", math.nan, "forced"),
    ("top_logprobs", 0.5, "above 0|exceeds"),
    ("top_logprobs", -9.0, "outranks|tail"),
    ("top_ids", 7, "vocabulary"),
])
def test_column_checker_and_row_decoder_refuse_the_same_tampering(field, value, match):
    plan = _fixture_plan(8)
    data = _tamper(plan, field, value)
    with pytest.raises(ShardError, match=match):
        binary.check_packed(data, "x.kdpack", plan)
    with pytest.raises(ShardError):
        binary.decode_packed_rows(data, "x.kdpack")


def test_column_checker_accepts_what_the_row_decoder_accepts():
    plan = _fixture_plan(4)
    data = binary.encode_packed(plan, [_packed_example(read_rows("rows-teacher-expert.jsonl"))])
    assert binary.check_packed(data, "x.kdpack", plan) == (["ex-1"], 1, 2)
    assert len(binary.decode_packed_rows(data, "x.kdpack")[1]) == 2
