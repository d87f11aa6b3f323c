"""Write-last publication, verification (corruption, path traversal, symlinks),
checkout-newline independence, fixture reproducibility and every resume row."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kiln.canonical import atomic_write_bytes, jsonl_c14n, sha256_hex
from kiln.distill import shards
from kiln.distill.contract import ShardManifest
from kiln.distill.errors import ShardError
from kiln.distill.shards import FOREIGN_RUN, RESUME_ACTIONS, resume, resume_decision, verify_shard

from tests.distill.conftest import FIXTURES, load_make_fixtures


def _head(shard: Path) -> ShardManifest:
    names = sorted(os.listdir(shard / "manifests"))
    return ShardManifest.parse((shard / "manifests" / names[-1]).read_bytes())


def test_committed_fixture_shard_verifies(expert_plan) -> None:
    verdict = verify_shard(FIXTURES / "shard-teacher-expert", expected_plan_sha256=expert_plan.digest())
    assert verdict.ok, verdict.problems
    assert (verdict.state, verdict.rows, verdict.tokens, verdict.decision) == ("available", 2, 2, "reuse")
    assert verify_shard(FIXTURES / "shard-student-rollout").ok


def test_shard_bytes_are_reconstructed_from_canonical_rows(expert_rows) -> None:
    """The committed payload equals canonical JSONL of the rows, whatever git did to newlines."""
    rebuilt = b"".join(r.canonical_bytes() + b"\n" for r in expert_rows)
    commitment = _head(FIXTURES / "shard-teacher-expert").payloads[0]
    assert (len(rebuilt), sha256_hex(rebuilt)) == (commitment.bytes, commitment.sha256)
    on_disk = (FIXTURES / "shard-teacher-expert" / commitment.path).read_bytes()
    assert b"\r" not in on_disk and on_disk == rebuilt


def test_checkout_newline_conversion_cannot_change_committed_bytes(tmp_path, expert_rows) -> None:
    attrs = (FIXTURES / ".gitattributes").read_text()
    assert "-text" in attrs.split()  # git must not convert line endings in this folder
    crlf = (FIXTURES / "rows-teacher-expert.jsonl").read_bytes().replace(b"\n", b"\r\n")
    commitment = _head(FIXTURES / "shard-teacher-expert").payloads[0]
    # A CRLF checkout of the rows still normalizes to exactly the committed payload hash ...
    assert jsonl_c14n(crlf).normalized_sha256 == commitment.sha256
    # ... while CRLF bytes inside a shard are detected as a mismatch, never accepted.
    shard = tmp_path / "s"
    shutil.copytree(FIXTURES / "shard-teacher-expert", shard)
    (shard / commitment.path).write_bytes(crlf)
    verdict = verify_shard(shard)
    assert not verdict.ok and verdict.decision == "quarantine-and-restart"


def test_fixtures_regenerate_byte_for_byte(tmp_path) -> None:
    load_make_fixtures().build(tmp_path)
    produced = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(FIXTURES)
        for p in FIXTURES.rglob("*")
        if p.is_file() and p.name not in {"make_fixtures.py", ".gitattributes"} and "__pycache__" not in p.parts
    )
    assert produced == committed
    for rel in produced:
        assert (tmp_path / rel).read_bytes() == (FIXTURES / rel).read_bytes(), rel


def test_publication_protocol_states(tmp_path, expert_plan, expert_rows) -> None:
    txn = shards.begin(tmp_path, expert_plan, "s0", "t0")
    assert txn == tmp_path / ".staging" / "t0"
    assert verify_shard(txn).decision == "resume-staging"
    shards.write_payload(txn, "rows-00000.jsonl", expert_rows)
    assert shards.mark_complete(txn).state == "complete"
    assert verify_shard(txn).decision == "verify-then-publish"
    assert shards.mark_verified(txn).state == "verified"
    assert verify_shard(txn).decision == "publish"
    assert not (tmp_path / "t0").exists()  # nothing visible before publication
    final = shards.publish(txn, tmp_path)
    assert final == tmp_path / "t0" and not txn.exists()
    assert [p.name for p in sorted((final / "manifests").iterdir())] == [
        "0-staging.json", "1-complete.json", "2-verified.json", "3-available.json"]
    verdict = verify_shard(final)
    assert verdict.ok and verdict.decision == "reuse"
    with pytest.raises(ShardError, match="already exists"):
        shards.begin(tmp_path, expert_plan, "s0", "t0")


def _manifest_names(txn: Path) -> list[str]:
    return sorted(p.name for p in (txn / "manifests").iterdir())


@pytest.mark.parametrize(
    "case", ["reordered", "duplicate", "gap", "foreign trajectory", "example split", "too many tokens"]
)
def test_rows_violating_the_plan_never_complete(tmp_path, expert_plan, expert_rows, rollout_rows, case) -> None:
    payloads = {
        "reordered": {"rows-00000.jsonl": [expert_rows[1], expert_rows[0]]},
        "duplicate": {"rows-00000.jsonl": [expert_rows[0], expert_rows[0]]},
        "gap": {"rows-00000.jsonl": [expert_rows[1]]},
        "foreign trajectory": {"rows-00000.jsonl": rollout_rows},
        # the same trajectory split over two payloads, in the wrong order by name
        "example split": {"rows-00000.jsonl": [expert_rows[1]], "rows-00001.jsonl": [expert_rows[0]]},
        "too many tokens": {"rows-00000.jsonl": expert_rows, "rows-00001.jsonl": expert_rows},
    }[case]
    txn = shards.begin(tmp_path, expert_plan, "s0", "t0")
    for name, rows in payloads.items():
        shards.write_payload(txn, name, rows)
    with pytest.raises(ShardError, match="cannot complete.*violate the plan"):
        shards.mark_complete(txn)
    assert _manifest_names(txn) == ["0-staging.json"]  # completion itself refused: still staging
    assert verify_shard(txn).decision == "quarantine-and-restart"


@pytest.mark.parametrize("dup", ["duplicate", "gap"])
def test_duplicate_or_missing_positions_fail_closed(tmp_path, expert_plan, expert_rows, dup) -> None:
    rows = [expert_rows[0], expert_rows[0]] if dup == "duplicate" else [expert_rows[1]]
    txn = shards.begin(tmp_path, expert_plan, "s0", "t0")
    shards.write_payload(txn, "rows-00000.jsonl", rows)
    verdict = verify_shard(txn)
    assert not verdict.ok and verdict.decision == "quarantine-and-restart"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "payload bit flip": lambda s: _flip_byte(s / "payload" / "rows-00000.jsonl"),
    "payload truncated": lambda s: (s / "payload" / "rows-00000.jsonl").write_bytes(
        (s / "payload" / "rows-00000.jsonl").read_bytes()[:-40]),
    "payload missing": lambda s: (s / "payload" / "rows-00000.jsonl").unlink(),
    "extra payload": lambda s: (s / "payload" / "rows-00001.jsonl").write_bytes(b""),
    "parseable changed row": lambda s: (s / "payload" / "rows-00000.jsonl").write_bytes(
        (s / "payload" / "rows-00000.jsonl").read_bytes().replace(b'"position":1', b'"position":2')),
    "plan changed": lambda s: (s / "plan.json").write_bytes(
        (s / "plan.json").read_bytes().replace(b'"run_id":"fixture-teacher-expert"', b'"run_id":"other"')),
    "manifest edited": lambda s: (s / "manifests" / "3-available.json").write_bytes(
        (s / "manifests" / "3-available.json").read_bytes().replace(b'"rows":2', b'"rows":2 ')),
    "manifest gap": lambda s: (s / "manifests" / "2-verified.json").unlink(),
    "manifests missing": lambda s: shutil.rmtree(s / "manifests") or (s / "manifests").mkdir(),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_detected(shard_copy: Path, kind: str) -> None:
    CORRUPTIONS[kind](shard_copy)
    verdict = verify_shard(shard_copy)
    assert not verdict.ok and verdict.problems
    assert verdict.decision == "quarantine-and-restart"


def test_mismatched_expected_plan_is_refused(shard_copy: Path) -> None:
    verdict = verify_shard(shard_copy, expected_plan_sha256="0" * 64)
    assert not verdict.ok and "expected" in verdict.problems[0]
    assert verdict.foreign and verdict.decision == FOREIGN_RUN


def test_manifest_path_traversal_is_refused(shard_copy: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.jsonl").write_bytes((shard_copy / "payload" / "rows-00000.jsonl").read_bytes())
    head_path = shard_copy / "manifests" / "3-available.json"
    obj = json.loads(head_path.read_bytes())
    obj["payloads"][0]["path"] = "../outside.jsonl"
    head_path.write_text(json.dumps(obj))
    verdict = verify_shard(shard_copy)
    assert not verdict.ok and "path" in verdict.problems[0]


def test_symlinked_payload_and_directories_are_refused(shard_copy: Path, tmp_path: Path) -> None:
    payload = shard_copy / "payload" / "rows-00000.jsonl"
    real = tmp_path / "real.jsonl"
    shutil.move(payload, real)
    payload.symlink_to(real)  # same bytes, but behind a link
    verdict = verify_shard(shard_copy)
    assert not verdict.ok and "symlink" in verdict.problems[0]
    payload.unlink()
    shutil.move(real, payload)
    moved = tmp_path / "payload-real"
    shutil.move(shard_copy / "payload", moved)
    (shard_copy / "payload").symlink_to(moved, target_is_directory=True)
    verdict = verify_shard(shard_copy)
    assert not verdict.ok and "symlink" in verdict.problems[0]
    link = tmp_path / "shard-link"
    link.symlink_to(shard_copy, target_is_directory=True)
    with pytest.raises(ShardError, match="symlink"):
        verify_shard(link)


# ------------------------------------------------------------- resume decisions


def test_resume_table_is_closed() -> None:
    for state in ("staging", "complete", "verified", "available", "quarantined", None):
        for intact in (True, False):
            assert resume_decision(state, intact, foreign=True) == FOREIGN_RUN == "refuse-foreign-run"
    assert RESUME_ACTIONS == {
        ("staging", True): "resume-staging",
        ("complete", True): "verify-then-publish",
        ("verified", True): "publish",
        ("available", True): "reuse",
    }
    for state in ("staging", "complete", "verified", "available", "quarantined", None, "bogus"):
        for intact in (True, False):
            expected = (
                "refuse" if state == "quarantined"
                else RESUME_ACTIONS.get((state, intact), "quarantine-and-restart")
            )
            assert resume_decision(state, intact) == expected


def _staged(root: Path, plan, rows, upto: str) -> Path:
    txn = shards.begin(root, plan, "s0", "t0")
    if upto == "staging":
        shards.write_payload(txn, "rows-00000.jsonl", rows)
        return txn
    shards.write_payload(txn, "rows-00000.jsonl", rows)
    shards.mark_complete(txn)
    if upto == "verified":
        shards.mark_verified(txn)
    return txn


def test_resume_staging_discards_uncommitted_fragments(tmp_path, expert_plan, expert_rows) -> None:
    txn = _staged(tmp_path, expert_plan, expert_rows[:1], "staging")
    fragment = txn / "payload" / ".rows-00001.jsonl.abc.tmp"
    fragment.write_bytes(b'{"partial":')
    decision, where = resume(txn, tmp_path, expert_plan)
    assert (decision, where) == ("resume-staging", txn) and not fragment.exists()
    assert (txn / "payload" / "rows-00000.jsonl").exists()


def test_resume_complete_verifies_then_publishes(tmp_path, expert_plan, expert_rows) -> None:
    txn = _staged(tmp_path, expert_plan, expert_rows, "complete")
    decision, where = resume(txn, tmp_path, expert_plan)
    assert decision == "verify-then-publish" and verify_shard(where).state == "available"


def test_resume_verified_publishes(tmp_path, expert_plan, expert_rows) -> None:
    txn = _staged(tmp_path, expert_plan, expert_rows, "verified")
    decision, where = resume(txn, tmp_path, expert_plan)
    assert decision == "publish" and where == tmp_path / "t0" and verify_shard(where).ok


def test_resume_after_crash_between_rename_and_available(tmp_path, expert_plan, expert_rows) -> None:
    txn = _staged(tmp_path, expert_plan, expert_rows, "verified")
    os.rename(txn, tmp_path / "t0")  # group renamed, available manifest never written
    decision, where = resume(tmp_path / "t0", tmp_path, expert_plan)
    assert decision == "publish" and verify_shard(where).state == "available"


def test_resume_available_reuses_without_change(shard_copy, expert_plan) -> None:
    before = {p: p.read_bytes() for p in shard_copy.rglob("*") if p.is_file()}
    assert resume(shard_copy, shard_copy.parent, expert_plan)[0] == "reuse"
    assert {p: p.read_bytes() for p in shard_copy.rglob("*") if p.is_file()} == before


def test_resume_quarantined_refuses(shard_copy, expert_plan) -> None:
    shards.quarantine(shard_copy, "operator found bit rot")
    payload = (shard_copy / "payload" / "rows-00000.jsonl").read_bytes()
    assert resume(shard_copy, shard_copy.parent, expert_plan)[0] == "refuse"
    assert _head(shard_copy).state == "quarantined"
    assert (shard_copy / "payload" / "rows-00000.jsonl").read_bytes() == payload  # never repaired


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _shard_in(tmp_path: Path, plan, rows, state: str) -> Path:
    if state == "available":
        shard = tmp_path / "t0"
        shutil.copytree(FIXTURES / "shard-teacher-expert", shard)
        return shard
    return _staged(tmp_path, plan, rows, state)


OWN_DECISION = {"staging": "resume-staging", "complete": "verify-then-publish", "verified": "publish",
                "available": "reuse"}


@pytest.mark.parametrize("state", ["staging", "complete", "verified", "available"])
def test_resume_under_a_foreign_plan_refuses_and_writes_nothing(
    tmp_path, expert_plan, rollout_plan, expert_rows, state
) -> None:
    shard = _shard_in(tmp_path, expert_plan, expert_rows, state)
    if state == "staging":
        (shard / "payload" / ".rows-00001.jsonl.abc.tmp").write_bytes(b'{"partial":')
    before = _snapshot(tmp_path)
    # Another run (rollout_plan) tries to resume this run's (expert_plan's) valid shard.
    decision, where = resume(shard, tmp_path, rollout_plan)
    assert (decision, where) == ("refuse-foreign-run", shard)
    assert _snapshot(tmp_path) == before  # every file of the other run is byte-identical
    assert _head(shard).state == state
    # The owning run still resumes it normally.
    assert resume(shard, tmp_path, expert_plan)[0] == OWN_DECISION[state]


@pytest.mark.parametrize("state", ["staging", "complete", "verified", "available"])
def test_resume_of_an_own_corrupt_shard_quarantines(tmp_path, expert_plan, expert_rows, state) -> None:
    shard = _shard_in(tmp_path, expert_plan, expert_rows, state)
    payload = shard / "payload" / "rows-00000.jsonl"
    # staging: a parseable changed row; later states: bytes differ from the commitment.
    payload.write_bytes(payload.read_bytes().replace(b'"position":1', b'"position":2'))
    decision, where = resume(shard, tmp_path, expert_plan)
    assert decision == "quarantine-and-restart"
    assert _head(where).state == "quarantined" and _head(where).quarantine_reason
    assert resume(where, tmp_path, expert_plan)[0] == "refuse"


def test_resume_with_a_changed_plan_json_of_an_own_shard_quarantines(shard_copy, expert_plan) -> None:
    """The manifests name this run's plan, so the shard is ours; its altered plan.json is corruption."""
    (shard_copy / "plan.json").write_bytes(
        (shard_copy / "plan.json").read_bytes().replace(b'"run_id":"fixture-teacher-expert"', b'"run_id":"other"'))
    assert resume(shard_copy, shard_copy.parent, expert_plan)[0] == "quarantine-and-restart"
    assert _head(shard_copy).state == "quarantined"


def test_resume_unreadable_chain_is_left_unusable(shard_copy, expert_plan) -> None:
    _flip_byte(shard_copy / "manifests" / "0-staging.json")
    decision, _ = resume(shard_copy, shard_copy.parent, expert_plan)
    assert decision == "quarantine-and-restart"
    assert not verify_shard(shard_copy).ok


def test_payloads_are_immutable_and_never_empty(tmp_path, expert_plan, expert_rows) -> None:
    txn = shards.begin(tmp_path, expert_plan, "s0", "t0")
    shards.write_payload(txn, "rows-00000.jsonl", expert_rows)
    with pytest.raises(ShardError, match="immutable"):
        shards.write_payload(txn, "rows-00000.jsonl", expert_rows)
    with pytest.raises(ShardError, match="payload name"):
        shards.write_payload(txn, "../x.jsonl", expert_rows)
    assert [p.name for p in (txn / "payload").iterdir()] == ["rows-00000.jsonl"]
    atomic_write_bytes(txn / "payload" / "rows-00000.jsonl", b"")  # emptied behind our back
    with pytest.raises(Exception, match="rows"):
        shards.mark_complete(txn)  # an empty payload is never committed
