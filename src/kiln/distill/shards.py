"""Shard publication (write-last manifests) and resume; verification is :mod:`kiln.distill.shard_verify`.

Layout under a publication root (one filesystem)::

    <root>/.staging/<transaction_id>/   work area; consumers never scan dot-dirs
    <root>/<transaction_id>/            the published group (one directory rename)
        plan.json                       canonical plan bytes; sha256 == plan_sha256
        manifests/<n>-<state>.json      the manifest chain, n = 0, 1, 2, ...
        payload/<name>.jsonl            canonical JSONL of capture-token rows, or
        payload/<name>.kdpack           the packed binary layout (``binary.py``)

Protocol: ``begin`` writes plan + staging manifest; ``write_payload`` writes each
payload through a synced temp sibling and rename; ``mark_complete`` hashes and
counts the bytes on disk and chains the complete manifest; ``mark_verified``
reopens and verifies everything, then chains the verified manifest; ``publish``
renames the directory as one group and writes the available manifest last.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from kiln.canonical import atomic_publish_dir, atomic_write_bytes, sha256_hex
from kiln.distill.contract import (
    SHARD_MANIFEST_SCHEMA,
    CaptureTokenRow,
    PayloadCommitment,
    Plan,
    ShardManifest,
    TokenizedTeacherExample,
)
from kiln.distill.errors import DistillError, ShardError
from kiln.distill.faults import fault
from kiln.distill.paths import check_relative_path
from kiln.distill.shard_verify import (  # noqa: F401  (reading, verification and resume decisions: the shard API)
    FOREIGN_RUN,
    MANIFEST_DIR,
    MAX_CHAIN_LENGTH,
    MAX_PAYLOAD_BYTES,
    MAX_ROWS_PER_PAYLOAD,
    PAYLOAD_DIR,
    PAYLOAD_NAME_RE,
    PLAN_FILE,
    RESUME_ACTIONS,
    STAGING_DIRNAME,
    TEMP_NAME_RE,
    Verdict,
    bytes_per_token,
    check_identity,
    check_rows_against_plan,
    check_shard_range,
    check_trajectories_against_dataset,
    duplicate_examples,
    parse_any_payload,
    parse_payload,
    payload_names,
    read_chain,
    read_json_artifact,
    read_manifest_chain,
    read_staged_payloads,
    resume_decision,
    run_bytes_per_token,
    run_complete,
    run_coverage,
    verify_shard,
)
from kiln.distill.states import check_manifest_step

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "MAX_ROWS_PER_PAYLOAD",
    "MAX_CHAIN_LENGTH",
    "STAGING_DIRNAME",
    "RESUME_ACTIONS",
    "Verdict",
    "resume_decision",
    "begin",
    "write_payload",
    "write_payload_bytes",
    "parse_any_payload",
    "mark_complete",
    "mark_verified",
    "publish",
    "quarantine",
    "capture_shard",
    "verify_shard",
    "parse_payload",
    "check_rows_against_plan",
    "check_trajectories_against_dataset",
    "resume",
    "read_manifest_chain",
    "FOREIGN_RUN",
    "foreign_transactions",
    "bytes_per_token",
    "run_bytes_per_token",
    "run_coverage",
    "run_complete",
    "duplicate_examples",
    "check_shard_range",
    "check_run_complete",
]


# -------------------------------------------------------------------- writing


def _write_manifest(root: Path, index: int, manifest: ShardManifest) -> ShardManifest:
    atomic_write_bytes(root / MANIFEST_DIR / f"{index}-{manifest.state}.json", manifest.canonical_bytes())
    return manifest


def _next_manifest(prev: ShardManifest, state: str, **changes: Any) -> ShardManifest:
    obj = prev.to_obj()
    obj.update(state=state, previous_manifest_sha256=prev.digest(), quarantine_reason=None)
    obj.update(changes)
    nxt = ShardManifest.parse(obj)
    check_manifest_step(prev, nxt)
    return nxt


def begin(root: str | os.PathLike[str], plan: Plan, shard_id: str, transaction_id: str) -> Path:
    """Create ``<root>/.staging/<transaction_id>`` with the plan and staging manifest."""
    txn = Path(root) / STAGING_DIRNAME / check_relative_path(transaction_id)
    if txn.exists() or (Path(root) / transaction_id).exists():
        raise ShardError(f"transaction {transaction_id!r} already exists under {root}; use a new ID")
    (txn / PAYLOAD_DIR).mkdir(parents=True)
    (txn / MANIFEST_DIR).mkdir()
    atomic_write_bytes(txn / PLAN_FILE, plan.canonical_bytes())
    staging = ShardManifest.parse(
        {
            "schema": SHARD_MANIFEST_SCHEMA,
            "shard_id": shard_id,
            "transaction_id": transaction_id,
            "state": "staging",
            "plan_sha256": plan.digest(),
            "tokenizer_sha256": plan.tokenizer.digest(),
            "dataset_sha256": plan.dataset.digest(),
            "previous_manifest_sha256": None,
            "rows": 0,
            "tokens": 0,
            "payloads": [],
            "quarantine_reason": None,
        }
    )
    _write_manifest(txn, 0, staging)
    return txn


def write_payload(txn: str | os.PathLike[str], name: str, rows: Iterable[CaptureTokenRow]) -> None:
    """Write one payload of canonical rows (temp sibling, fsync, rename)."""
    if not PAYLOAD_NAME_RE.fullmatch(name):
        raise ShardError(f"payload name {name!r} must match {PAYLOAD_NAME_RE.pattern}")
    target = Path(txn) / PAYLOAD_DIR / name
    if target.exists():
        raise ShardError(f"payload {name} already written; payloads are immutable")
    atomic_write_bytes(target, b"".join(r.canonical_bytes() + b"\n" for r in rows))


def write_payload_bytes(txn: str | os.PathLike[str], name: str, data: bytes) -> None:
    """Write one already encoded payload (e.g. a packed ``*.kdpack``) the same way."""
    if not PAYLOAD_NAME_RE.fullmatch(name):
        raise ShardError(f"payload name {name!r} must match {PAYLOAD_NAME_RE.pattern}")
    target = Path(txn) / PAYLOAD_DIR / name
    if target.exists():
        raise ShardError(f"payload {name} already written; payloads are immutable")
    atomic_write_bytes(target, data)


def mark_complete(
    txn: str | os.PathLike[str],
    *,
    examples: Mapping[str, TokenizedTeacherExample] | None = None,
    shard_range: Sequence[str] | None = None,
) -> ShardManifest:
    """Check, hash and count the payload bytes on disk and chain the complete manifest.

    The rows must already satisfy the plan (``check_rows_against_plan``: whole,
    ordered trajectories, positions 0, 1, 2, ... with chained contexts, no
    duplicate or reordered record, at most ``planned_tokens``), so a shard that
    violates its plan never reaches ``complete``. With ``examples`` (the capture
    worker always passes its dataset) each trajectory must also be a whole
    dataset example, and with ``shard_range`` the shard must hold exactly that range.
    Commitments are computed from the same bytes that were checked.
    """
    txn = Path(txn)
    chain = read_chain(txn)
    head = chain[-1]
    if head.state != "staging":
        raise ShardError(f"cannot complete a {head.state!r} transaction")
    fragments = [n for n in payload_names(txn) if TEMP_NAME_RE.fullmatch(n)]
    if fragments:
        raise ShardError(f"uncommitted fragment {fragments[0]} present; resume the staging transaction first")
    plan = read_json_artifact(txn, PLAN_FILE, Plan)
    check_identity(head, plan)
    try:
        staged, ids = read_staged_payloads(txn, plan, examples, shard_range)
        if shard_range is not None:
            check_shard_range(ids, shard_range)
    except ShardError as exc:
        raise ShardError(
            f"cannot complete {txn.name}: {exc}; the staged rows violate the plan, "
            "quarantine this transaction and recapture under a new transaction ID"
        ) from exc
    commitments = []
    for rel, raw, n_rows, n_tokens in staged:
        if not n_tokens:
            raise ShardError(f"{rel} holds no rows; an empty payload is never committed")
        commitments.append(
            PayloadCommitment(
                path=rel, bytes=len(raw), rows=n_rows, tokens=n_tokens, sha256=sha256_hex(raw)
            ).to_obj()
        )
    complete = _next_manifest(
        head,
        "complete",
        payloads=commitments,
        rows=sum(c["rows"] for c in commitments),
        tokens=sum(c["tokens"] for c in commitments),
    )
    return _write_manifest(txn, len(chain), complete)


def mark_verified(
    txn: str | os.PathLike[str],
    *,
    examples: Mapping[str, TokenizedTeacherExample] | None = None,
    shard_range: Sequence[str] | None = None,
) -> ShardManifest:
    """Reopen and verify every payload (against ``examples`` and ``shard_range`` too when given); chain
    the verified manifest only if all pass."""
    txn = Path(txn)
    verdict = verify_shard(txn, examples=examples, shard_range=shard_range)
    if not verdict.ok or verdict.state != "complete":
        raise ShardError(f"cannot mark verified: state {verdict.state!r}, problems {verdict.problems}")
    chain = read_chain(txn)
    return _write_manifest(txn, len(chain), _next_manifest(chain[-1], "verified"))


def publish(txn: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """Rename the verified group into ``<root>/<transaction_id>``; write available last.

    The rename is one atomic step: either the whole group is visible or none of
    it. If the available manifest cannot be written, the group stays ``verified``
    and ``resume`` publishes it again.
    """
    txn = Path(txn)
    chain = read_chain(txn)
    head = chain[-1]
    if head.state != "verified":
        raise ShardError(f"only a verified transaction is published, not {head.state!r}")
    final = Path(root) / head.transaction_id
    if txn.resolve() != final.resolve():
        atomic_publish_dir(txn, final)
    fault("publish_after_rename")
    _write_manifest(final, len(chain), _next_manifest(head, "available"))
    return final


def quarantine(shard_dir: str | os.PathLike[str], reason: str) -> ShardManifest:
    """Chain a quarantined manifest; payload bytes stay exactly as found."""
    shard_dir = Path(shard_dir)
    chain = read_chain(shard_dir)
    q = _next_manifest(chain[-1], "quarantined", quarantine_reason=reason[:1024])
    return _write_manifest(shard_dir, len(chain), q)


def capture_shard(
    root: str | os.PathLike[str],
    plan: Plan,
    shard_id: str,
    transaction_id: str,
    payloads: dict[str, Sequence[CaptureTokenRow]],
    *,
    examples: Mapping[str, TokenizedTeacherExample] | None = None,
) -> Path:
    """Run the whole write-last protocol for already captured rows (checked against ``examples``
    when given)."""
    txn = begin(root, plan, shard_id, transaction_id)
    for name in sorted(payloads):
        write_payload(txn, name, payloads[name])
    mark_complete(txn, examples=examples)
    mark_verified(txn, examples=examples)
    return publish(txn, root)


def resume(
    shard_dir: str | os.PathLike[str],
    root: str | os.PathLike[str],
    plan: Plan,
    *,
    examples: Mapping[str, TokenizedTeacherExample] | None = None,
    shard_range: Sequence[str] | None = None,
) -> tuple[str, Path]:
    """Apply the resume table to one transaction directory of ``plan`` (for the examples of
    ``shard_range`` when given: a shard holding another range is mismatched).

    Returns (decision, directory). ``resume-staging`` removes uncommitted temp
    fragments and hands the staging directory back for more payloads;
    ``verify-then-publish`` and ``publish`` finish publication; ``reuse`` leaves
    an available shard alone; ``quarantine-and-restart`` chains a quarantined
    manifest when the chain is readable (otherwise the directory is left as it is,
    already unusable) and the caller starts a new transaction ID; ``refuse``
    changes nothing. ``refuse-foreign-run`` (the manifests name another plan)
    changes nothing either: the shard belongs to another run and stays
    byte-for-byte as it was; the caller starts a new run under its own root.
    """
    shard_dir = Path(shard_dir)
    verdict = verify_shard(shard_dir, expected_plan_sha256=plan.digest(), examples=examples, shard_range=shard_range)
    decision = verdict.decision
    if decision == "resume-staging":
        for name in payload_names(shard_dir):
            if TEMP_NAME_RE.fullmatch(name):
                os.unlink(shard_dir / PAYLOAD_DIR / name)
    elif decision == "verify-then-publish":
        mark_verified(shard_dir, examples=examples, shard_range=shard_range)
        shard_dir = publish(shard_dir, root)
    elif decision == "publish":
        shard_dir = publish(shard_dir, root)
    elif decision == "quarantine-and-restart":
        try:
            quarantine(shard_dir, "; ".join(verdict.problems) or "integrity check failed")
        except (DistillError, OSError):
            pass  # unreadable chain: nothing can be chained; the directory is never reused
    return decision, shard_dir


def foreign_transactions(root: str | os.PathLike[str], plan_sha256: str) -> list[str]:
    """Transaction directories under a publication root (published or staging) whose manifests name
    another plan. Read-only: a run that finds any refuses to write anything under that root (the spec's
    threat model: a mixed run is refused and a new run is created). Directories whose chain cannot be
    read are not counted here; the resume table deals with them under their own plan."""
    root = Path(root)
    found = []
    for base in (root, root / STAGING_DIRNAME):
        if base.is_symlink() or not base.is_dir():
            continue
        for entry in sorted(base.iterdir()):
            if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
                continue
            try:
                head = read_chain(entry)[-1]
            except (DistillError, OSError):
                continue
            if head.plan_sha256 != plan_sha256:
                found.append(str(entry.relative_to(root)))
    return found


def check_run_complete(root: Path, plan: Plan) -> list[Any]:
    """Verdicts of the intact available shards under ``root``; refuses unless they hold every planned
    example exactly once (``planned_tokens`` tokens, ``dataset.rows`` examples, no duplicate)."""
    verdicts = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        verdict = verify_shard(entry, expected_plan_sha256=plan.digest())
        if verdict.ok and verdict.state == "available":
            verdicts.append(verdict)
    problems = run_coverage(verdicts, plan)
    if problems or not run_complete(verdicts, plan):
        tokens = sum(v.tokens or 0 for v in verdicts)
        detail = "".join(f"; {p}" for p in problems)
        raise ShardError(
            f"the run's available shards hold {tokens} of {plan.capture.planned_tokens} planned tokens{detail}; "
            "a run is complete only when its shards cover every planned example once"
        )
    return verdicts
