"""Reading and verifying a shard transaction directory, resume decisions, and bytes per token.

The layout and the write protocol are :mod:`kiln.distill.shards`'; this module reads what it
wrote: the manifest chain, the payloads (JSONL or ``.kdpack``) checked against the plan and the
teacher dataset, a :class:`Verdict` per transaction directory and the one allowed resume action
for it (:func:`resume_decision`), and the payload bytes each token cost.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from kiln.canonical import sha256_hex
from kiln.distill.contract import (
    MAX_ARTIFACT_JSON_BYTES,
    MAX_PAYLOADS,
    CaptureTokenRow,
    Plan,
    ShardManifest,
    TokenizedTeacherExample,
)
from kiln.distill.errors import ContractError, DistillError, ShardError
from kiln.distill.paths import list_regular_files, read_bytes_nofollow
from kiln.distill.states import check_manifest_chain

MAX_PAYLOAD_BYTES = 1 << 30
MAX_ROWS_PER_PAYLOAD = 10_000_000
MAX_CHAIN_LENGTH = 5  # staging, complete, verified, available, quarantined
STAGING_DIRNAME = ".staging"
PLAN_FILE = "plan.json"
MANIFEST_DIR = "manifests"
PAYLOAD_DIR = "payload"

_MANIFEST_NAME = re.compile(r"^([0-9])-([a-z]+)\.json$")
PAYLOAD_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.(jsonl|kdpack)$")
TEMP_NAME_RE = re.compile(r"^\..+\.tmp$")

# A shard whose manifests name another plan belongs to another run. Resuming or
# consuming it under this plan is refused and nothing in it is written.
FOREIGN_RUN = "refuse-foreign-run"

# The closed resume table: (observed state, integrity ok) -> action.
RESUME_ACTIONS: dict[tuple[str, bool], str] = {
    ("staging", True): "resume-staging",
    ("complete", True): "verify-then-publish",
    ("verified", True): "publish",
    ("available", True): "reuse",
}


def resume_decision(state: str | None, intact: bool, foreign: bool = False) -> str:
    """Map an observed shard state and its integrity to the one allowed action.

    A shard of another plan (``foreign``) is refused without being touched: the
    threat model says a mixed run refuses resume and creates a new run, so a
    foreign plan never quarantines another run's shard. ``quarantined`` always
    refuses; valid staging/complete/verified/available resume, verify+publish,
    publish or reuse; anything else (corruption, fingerprints that disagree with
    the shard's own plan, or no readable state) is quarantined and a new
    transaction is started.
    """
    if foreign:
        return FOREIGN_RUN
    if state == "quarantined":
        return "refuse"
    return RESUME_ACTIONS.get((state, intact), "quarantine-and-restart") if state else "quarantine-and-restart"


@dataclass
class Verdict:
    """Outcome of verifying one transaction directory."""

    path: str
    state: str | None = None
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    shard_id: str | None = None
    transaction_id: str | None = None
    plan_sha256: str | None = None
    manifest_sha256: str | None = None
    rows: int | None = None
    tokens: int | None = None
    payload_bytes: int | None = None
    foreign: bool = False
    plan: Plan | None = field(default=None, repr=False, compare=False)
    # Example IDs of the checked payloads, in order (None when the payloads were not read).
    example_ids: list[str] | None = field(default=None, repr=False, compare=False)

    @property
    def decision(self) -> str:
        return resume_decision(self.state, self.ok, self.foreign)

    def to_obj(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "state": self.state,
            "ok": self.ok,
            "problems": list(self.problems),
            "shard_id": self.shard_id,
            "transaction_id": self.transaction_id,
            "plan_sha256": self.plan_sha256,
            "manifest_sha256": self.manifest_sha256,
            "rows": self.rows,
            "tokens": self.tokens,
            "payload_bytes": self.payload_bytes,
            "foreign": self.foreign,
        }


# -------------------------------------------------------------------- reading


def read_json_artifact(root: Path, rel: str, model: type) -> Any:
    raw = read_bytes_nofollow(root, rel, max_bytes=MAX_ARTIFACT_JSON_BYTES)
    doc = model.parse(raw)
    if doc.canonical_bytes() != raw:
        raise ContractError(f"{rel} is not stored as canonical JSON bytes")
    return doc


def read_manifest_chain(shard_dir: str | os.PathLike[str]) -> list[ShardManifest]:
    """The shard's validated manifest chain, oldest first (the durable registry record).

    Raises ``ShardError``/``ContractError``/``TransitionError`` if it cannot be
    read as one legal chain.
    """
    return read_chain(Path(shard_dir))


def read_chain(shard_dir: Path) -> list[ShardManifest]:
    names = list_regular_files(shard_dir, MANIFEST_DIR, max_entries=MAX_CHAIN_LENGTH + 8)
    names = [n for n in names if not TEMP_NAME_RE.fullmatch(n)]
    if not names:
        raise ShardError("no manifest: an interrupted transaction before its staging manifest")
    if len(names) > MAX_CHAIN_LENGTH:
        raise ShardError(f"more than {MAX_CHAIN_LENGTH} manifests")
    chain = []
    for i, name in enumerate(sorted(names)):
        m = _MANIFEST_NAME.fullmatch(name)
        if not m or int(m.group(1)) != i:
            raise ShardError(f"unexpected manifest file {name!r}; expected {i}-<state>.json")
        manifest = read_json_artifact(shard_dir, f"{MANIFEST_DIR}/{name}", ShardManifest)
        if manifest.state != m.group(2):
            raise ShardError(f"{name} holds a {manifest.state!r} manifest")
        chain.append(manifest)
    check_manifest_chain(chain)
    return chain


def parse_payload(raw: bytes, name: str) -> list[CaptureTokenRow]:
    """Parse a payload that must be canonical JSONL (every row canonical, LF-ended)."""
    if raw and not raw.endswith(b"\n"):
        raise ShardError(f"{name}: final row is not LF-terminated (truncated write?)")
    rows = []
    for i, line in enumerate(raw.split(b"\n")[:-1], start=1):
        if i > MAX_ROWS_PER_PAYLOAD:
            raise ShardError(f"{name}: more than {MAX_ROWS_PER_PAYLOAD} rows")
        try:
            row = CaptureTokenRow.parse(line)
        except DistillError as exc:
            raise ShardError(f"{name} row {i}: {exc}") from exc
        if row.canonical_bytes() != line:
            raise ShardError(f"{name} row {i} is not canonical JSON")
        rows.append(row)
    return rows


def parse_any_payload(raw: bytes, name: str, plan: Plan | None) -> tuple[list[CaptureTokenRow], int, int]:
    """(rows, committed row count, committed token count) of one payload of either layout.

    JSONL: one record per position, so rows == tokens. Packed (``*.kdpack``): rows
    are example trajectories, tokens are positions; its header must equal what
    the plan implies.
    """
    if name.endswith(".kdpack"):
        from kiln.distill.binary import check_header_against_plan, decode_packed_rows

        header, parsed = decode_packed_rows(raw, name)
        if plan is not None:
            check_header_against_plan(header, plan, name)
        return parsed, header["examples"], len(parsed)
    parsed = parse_payload(raw, name)
    return parsed, len(parsed), len(parsed)


def check_rows_against_plan(rows: Sequence[CaptureTokenRow], plan: Plan) -> None:
    """Rows must follow the plan and form whole, ordered example trajectories.

    Per example: positions 0, 1, 2, ... in order with no gap or duplicate, each
    context extending the previous one by its forced token (cut to
    ``max_sequence_length`` from the left under left truncation), and no example
    reappearing after another one started.
    """
    cap, prob, traj = plan.capture, plan.probability, plan.consumption.trajectory
    if len(rows) > cap.planned_tokens:
        raise ShardError(f"{len(rows)} records exceed the plan's planned_tokens {cap.planned_tokens}")
    seen: set[str] = set()
    prev: CaptureTokenRow | None = None
    for n, row in enumerate(rows, start=1):
        where = f"row {n} ({row.example_id}@{row.position})"
        if row.trajectory != traj:
            raise ShardError(f"{where}: trajectory {row.trajectory!r}, plan says {traj!r}")
        if row.vocab_size != plan.tokenizer.vocab_size:
            raise ShardError(f"{where}: vocab_size {row.vocab_size} differs from the plan's tokenizer")
        if len(row.top_k_ids) != prob.top_k or len(row.forced_ids) > cap.max_forced_ids:
            raise ShardError(f"{where}: top-k width or forced-ID count differs from the plan")
        if row.temperature != prob.temperature:
            raise ShardError(f"{where}: temperature {row.temperature} differs from the plan")
        if len(row.context_token_ids) > cap.max_sequence_length:
            raise ShardError(f"{where}: context longer than max_sequence_length")
        if prev is not None and prev.example_id == row.example_id:
            if row.position != prev.position + 1:
                raise ShardError(f"{where}: position follows {prev.position}; duplicate or reordered record")
            expected = prev.context_token_ids + (prev.forced_token_id,)
            if len(expected) > cap.max_sequence_length:
                if cap.truncation != "left":
                    raise ShardError(f"{where}: right truncation cannot capture past max_sequence_length")
                expected = expected[-cap.max_sequence_length :]
            if row.context_token_ids != expected:
                raise ShardError(f"{where}: context does not extend the previous position's context")
        else:
            if row.example_id in seen:
                raise ShardError(f"{where}: example reappears; trajectories are never split or repeated")
            if row.position != 0:
                raise ShardError(f"{where}: an example's first record must be position 0")
            seen.add(row.example_id)
        prev = row


def verify_shard(
    shard_dir: str | os.PathLike[str],
    *,
    expected_plan_sha256: str | None = None,
    examples: Mapping[str, TokenizedTeacherExample] | None = None,
    shard_range: Sequence[str] | None = None,
) -> Verdict:
    """Reopen a transaction directory and check every commitment.

    Checks the manifest chain, plan hash (and ``expected_plan_sha256`` when
    given), tokenizer and dataset fingerprints, and, from ``complete`` on,
    payload membership, byte counts, SHA-256, parseability, row/token counts and
    row semantics against the plan, and with ``examples`` (the plan's dataset by
    example ID, see :func:`load_dataset_examples`) every trajectory against the
    dataset. With ``shard_range`` (the ordered example IDs this shard covers in the
    caller's run) a committed shard must hold exactly that range and a staging one
    a prefix of it: a shard is reusable only for exactly its range.
    Raises ``ShardError`` only when the path is not a real directory;
    every integrity problem is reported in the verdict.
    """
    root = Path(shard_dir)
    if root.is_symlink() or not root.is_dir():
        raise ShardError(f"{root} is not a directory (symlinks are refused)")
    verdict = Verdict(path=str(root))
    try:
        chain = read_chain(root)
        head = chain[-1]
        verdict.state, verdict.shard_id, verdict.transaction_id = head.state, head.shard_id, head.transaction_id
        verdict.manifest_sha256, verdict.plan_sha256 = head.digest(), head.plan_sha256
        verdict.rows, verdict.tokens = head.rows, head.tokens
        if head.state != "staging":
            verdict.payload_bytes = sum(p.bytes for p in head.payloads)
        if expected_plan_sha256 is not None and head.plan_sha256 != expected_plan_sha256:
            # Another run's shard: report it and read nothing further.
            verdict.foreign = True
            raise ShardError(
                f"shard belongs to plan {head.plan_sha256}, not the expected {expected_plan_sha256}; "
                "a mixed run is refused: start a new transaction under this plan's own root"
            )
        plan = read_json_artifact(root, PLAN_FILE, Plan)
        check_identity(head, plan)
        verdict.plan = plan
        if head.state == "staging":
            verdict.example_ids = read_staged_payloads(root, plan, examples, shard_range)[1]
        else:
            # A quarantined manifest keeps its evidence; its payloads are checked too
            # but the resume decision refuses regardless.
            verdict.example_ids = _check_committed_payloads(root, head, plan, examples, shard_range)
    except DistillError as exc:
        verdict.problems.append(str(exc))
    except OSError as exc:
        verdict.problems.append(f"cannot read shard: {exc}")
    verdict.ok = not verdict.problems
    return verdict


def check_identity(head: ShardManifest, plan: Plan) -> None:
    if head.plan_sha256 != plan.digest():
        raise ShardError("manifest plan_sha256 does not match plan.json")
    if head.tokenizer_sha256 != plan.tokenizer.digest():
        raise ShardError("manifest tokenizer fingerprint differs from the plan's tokenizer")
    if head.dataset_sha256 != plan.dataset.digest():
        raise ShardError("manifest dataset fingerprint differs from the plan's dataset")


def payload_names(root: Path) -> list[str]:
    return list_regular_files(root, PAYLOAD_DIR, max_entries=MAX_PAYLOADS + 64)


def _check_payload_set(
    items: Sequence[tuple[str, bytes]],
    plan: Plan,
    examples: Mapping[str, TokenizedTeacherExample] | None = None,
    shard_range: Sequence[str] | None = None,
    *,
    staged: bool = False,
) -> tuple[list[tuple[str, bytes, int, int]], list[str]]:
    """Check payloads (in name order) as one shard; return ((path, bytes, rows, tokens) each, example IDs).

    JSONL rows are parsed and checked together with ``check_rows_against_plan``;
    packed payloads are checked column-wise by ``binary.check_packed`` (same rules).
    In both layouts an example lives in exactly one payload ("Ranges never split
    one example trajectory"). One shard uses one layout. With ``examples`` (the
    plan's dataset by example ID) every trajectory must also be one of them, whole:
    see :func:`check_trajectories_against_dataset`. With ``shard_range`` the example IDs
    must be exactly that range (``staged``: a prefix of it).
    """
    from kiln.distill.binary import PACKED_SUFFIX, check_packed, packed_trajectories

    kinds = {rel.endswith(PACKED_SUFFIX) for rel, _raw in items}
    if len(kinds) > 1:
        raise ShardError("a shard mixes JSONL and packed payloads; one shard uses one layout")
    out, rows, seen, tokens = [], [], set(), 0
    order: list[str] = []
    trajectories: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []
    for rel, raw in items:
        if rel.endswith(PACKED_SUFFIX):
            ids, n_rows, n_tokens = check_packed(raw, rel, plan)
            if examples is not None:
                trajectories += [(rel, *t) for t in packed_trajectories(raw, rel)]
        else:
            parsed = parse_payload(raw, rel)
            rows += parsed
            n_rows = n_tokens = len(parsed)
            ids = list(dict.fromkeys(r.example_id for r in parsed))
            trajectories += [(rel, *t) for t in _row_trajectories(parsed)]
        if seen.intersection(ids):
            raise ShardError(f"{rel}: an example reappears; trajectories are never split or repeated")
        seen.update(ids)
        order += ids
        tokens += n_tokens
        out.append((rel, raw, n_rows, n_tokens))
    if rows:
        check_rows_against_plan(rows, plan)
    if tokens > plan.capture.planned_tokens:
        raise ShardError(f"{tokens} records exceed the plan's planned_tokens {plan.capture.planned_tokens}")
    if examples is not None:
        check_trajectories_against_dataset(trajectories, examples, plan, shard_range)
    if shard_range is not None:
        check_shard_range(order, shard_range, staged=staged)
    return out, order


def describe_range(shard_range: Sequence[str]) -> str:
    if not shard_range:
        return "an empty range"
    return f"the range {shard_range[0]}..{shard_range[-1]} ({len(shard_range)} examples)"


def check_shard_range(ids: Sequence[str], shard_range: Sequence[str], *, staged: bool = False) -> None:
    """A committed shard holds exactly its range, in order; a staging one a prefix of it."""
    want = list(shard_range[: len(ids)]) if staged else list(shard_range)
    if list(ids) != want:
        raise ShardError(
            f"the shard holds {describe_range(list(ids))}, not this run's {describe_range(list(shard_range))}: "
            "a shard is reusable only for exactly its example range (was it captured with another "
            "--examples-per-shard?)"
        )


def _row_trajectories(rows: Sequence[CaptureTokenRow]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(example ID, position-0 context, forced tokens) of each run of consecutive rows of one example."""
    out: list[tuple[str, tuple[int, ...], list[int]]] = []
    for row in rows:
        if out and out[-1][0] == row.example_id:
            out[-1][2].append(row.forced_token_id)
        else:
            out.append((row.example_id, tuple(row.context_token_ids), [row.forced_token_id]))
    return [(eid, ctx, tuple(forced)) for eid, ctx, forced in out]


def check_trajectories_against_dataset(
    trajectories: Sequence[tuple[str, str, tuple[int, ...], tuple[int, ...]]],
    examples: Mapping[str, TokenizedTeacherExample],
    plan: Plan,
    shard_range: Sequence[str] | None = None,
) -> None:
    """Each captured trajectory (payload, example ID, position-0 context, forced tokens) must be a
    dataset example, whole: its ID in the dataset, its first context the example's prompt (its last
    ``max_sequence_length`` IDs, as capture records it) and its forced tokens exactly the example's
    ``target_token_ids``, in order and complete. With ``shard_range``, a dataset example outside
    it is named as such (a shard captured under another range), not as unknown."""
    limit = plan.capture.max_sequence_length
    inside = None if shard_range is None else set(shard_range)
    for rel, eid, ctx, forced in trajectories:
        ex = examples.get(eid)
        if ex is None:
            raise ShardError(f"{rel}: example {eid!r} is not in the plan's dataset")
        if inside is not None and eid not in inside:
            raise ShardError(
                f"{rel}: example {eid!r} is in the plan's dataset but outside this shard's "
                f"{describe_range(list(shard_range))}: the shard was captured under another example range"
            )
        if tuple(ctx) != tuple(ex.prompt_token_ids[-limit:]):
            raise ShardError(f"{rel}: example {eid!r}: the captured context contradicts the dataset prompt")
        if tuple(forced) != tuple(ex.target_token_ids):
            raise ShardError(
                f"{rel}: example {eid!r}: the captured tokens are not the dataset's target_token_ids "
                f"({len(forced)} captured, {len(ex.target_token_ids)} in the dataset)"
            )


def read_staged_payloads(
    root: Path,
    plan: Plan,
    examples: Mapping[str, TokenizedTeacherExample] | None = None,
    shard_range: Sequence[str] | None = None,
) -> tuple[list[tuple[str, bytes, int, int]], list[str]]:
    """((relative path, exact bytes, row count, token count) of every whole staged payload, checked;
    the example IDs they hold, in order)."""
    items = []
    for name in payload_names(root):
        if TEMP_NAME_RE.fullmatch(name):
            continue  # an uncommitted fragment: discarded on resume, never read
        rel = f"{PAYLOAD_DIR}/{name}"
        items.append((rel, read_bytes_nofollow(root, rel, max_bytes=MAX_PAYLOAD_BYTES)))
    return _check_payload_set(items, plan, examples, shard_range, staged=True)


def _check_committed_payloads(
    root: Path,
    head: ShardManifest,
    plan: Plan,
    examples: Mapping[str, TokenizedTeacherExample] | None,
    shard_range: Sequence[str] | None,
) -> list[str]:
    on_disk = {f"{PAYLOAD_DIR}/{n}" for n in payload_names(root)}
    committed = {p.path for p in head.payloads}
    if on_disk != committed:
        missing, extra = sorted(committed - on_disk), sorted(on_disk - committed)
        raise ShardError(f"payload membership differs: missing {missing}, unlisted {extra}")
    items = []
    for p in head.payloads:
        raw = read_bytes_nofollow(root, p.path, max_bytes=MAX_PAYLOAD_BYTES)
        if len(raw) != p.bytes:
            raise ShardError(f"{p.path}: {len(raw)} bytes on disk, {p.bytes} committed")
        if sha256_hex(raw) != p.sha256:
            raise ShardError(f"{p.path}: SHA-256 differs from its commitment (tampering or bit rot)")
        items.append((p.path, raw))
    checked, ids = _check_payload_set(items, plan, examples, shard_range)
    for (rel, _raw, n_rows, n_tokens), p in zip(checked, head.payloads):
        if n_rows != p.rows or n_tokens != p.tokens:
            raise ShardError(f"{rel}: {n_rows}/{n_tokens} rows/tokens on disk, {p.rows}/{p.tokens} committed")
    return ids


# ------------------------------------------------------------ bytes per token


def _planned_per_token(plan: Plan | None) -> dict[str, Any]:
    sparse = dense = None
    if plan is not None:
        # The estimate is N times a per-token figure, so these divisions are exact.
        n = plan.capture.planned_tokens
        sparse, dense = plan.estimate.sparse_upper_bytes // n, plan.estimate.dense_bytes // n
    return {"planned_sparse_upper": sparse, "planned_dense": dense, "planned_excludes_metadata": True}


def _observed(payload_bytes: int | None, tokens: int | None) -> dict[str, Any]:
    known = payload_bytes is not None and bool(tokens)
    return {
        "observed": payload_bytes / tokens if known else None,  # type: ignore[operator]
        "observed_bytes": payload_bytes if known else None,
        "observed_tokens": tokens if known else None,
    }


def _committed(verdict: Verdict) -> bool:
    """Intact and past staging: its payload commitments were checked against the bytes."""
    return verdict.ok and verdict.state not in (None, "staging")


def bytes_per_token(verdict: Verdict) -> dict[str, Any]:
    """Planned vs observed bytes per captured token of one verified shard.

    Planned figures come from the shard's plan: ``planned_sparse_upper`` =
    sparse_upper_bytes / N and ``planned_dense`` = dense_bytes / N, raw widths
    only (``planned_excludes_metadata``). ``observed`` is the committed payload
    bytes on disk (JSON and all) over the committed tokens; it is ``null`` until
    the shard has verified commitments (staging, or a failed verification).
    """
    if _committed(verdict):
        return {**_planned_per_token(verdict.plan), **_observed(verdict.payload_bytes, verdict.tokens)}
    return {**_planned_per_token(verdict.plan), **_observed(None, None)}


def duplicate_examples(verdicts: Sequence[Verdict]) -> list[str]:
    """One line per example held by more than one of ``verdicts`` (naming every transaction)."""
    holders: dict[str, list[str]] = {}
    for v in verdicts:
        for eid in v.example_ids or ():
            holders.setdefault(eid, []).append(str(v.transaction_id))
    return [f"example {eid!r} is in {', '.join(txns)}" for eid, txns in holders.items() if len(txns) > 1]


def run_coverage(verdicts: Sequence[Verdict], plan: Plan, dataset_ids: Sequence[str] | None = None) -> list[str]:
    """Problems of a run's counted shards as a whole: each planned example at most once, never more
    tokens than planned, and (``dataset_ids``) no example the shards hold that the dataset lacks.
    Empty means no duplicate; the run is complete when it is empty and the tokens equal the plan's."""
    problems = []
    dups = duplicate_examples(verdicts)
    if dups:
        problems.append(
            f"{len(dups)} example(s) held by more than one shard ({'; '.join(dups[:5])}): a run holds each "
            "planned example once; duplicate records fail closed"
        )
    tokens = sum(v.tokens or 0 for v in verdicts)
    if tokens > plan.capture.planned_tokens:
        problems.append(f"{tokens} observed tokens exceed the plan's planned_tokens {plan.capture.planned_tokens}")
    if dataset_ids is not None:
        missing = sorted(set(dataset_ids) - {e for v in verdicts for e in v.example_ids or ()})
        if missing and not dups and tokens == plan.capture.planned_tokens:
            problems.append(f"examples {missing[:5]} are in no shard although the token count matches")
    return problems


def run_complete(verdicts: Sequence[Verdict], plan: Plan) -> bool:
    """Every planned example exactly once: no duplicate, ``dataset.rows`` examples, ``planned_tokens`` tokens."""
    ids = [e for v in verdicts for e in v.example_ids or ()]
    return (
        all(v.example_ids is not None for v in verdicts)
        and len(ids) == len(set(ids)) == plan.dataset.rows
        and sum(v.tokens or 0 for v in verdicts) == plan.capture.planned_tokens
    )


def run_bytes_per_token(verdicts: Sequence[Verdict], dataset_ids: Sequence[str] | None = None) -> dict[str, Any]:
    """Planned vs observed bytes per token over the shards of one run, and whether the run is whole.

    Observed sums the intact, committed shards that are not quarantined
    (complete/verified/available). Shards of more than one plan are a mixed
    run: the summary names the problem and reports no planned figures.
    ``complete`` is true when those shards hold every planned example exactly once
    (:func:`run_complete`); duplicates and a token count above the plan's are problems.
    """
    plans = {v.plan_sha256: v.plan for v in verdicts if v.plan is not None}
    plan = next(iter(plans.values())) if len(plans) == 1 else None
    counted = [v for v in verdicts if _committed(v) and v.state != "quarantined"]
    problems = []
    if len(plans) > 1:
        problems.append(f"mixed run: the shards belong to {len(plans)} plans; verify one run at a time")
    if len(counted) < len(verdicts):
        problems.append(
            f"{len(verdicts) - len(counted)} shard(s) not counted (failed verification, staging or quarantined)"
        )
    if plan is not None:
        problems += run_coverage(counted, plan, dataset_ids)
    observed_bytes = sum(v.payload_bytes or 0 for v in counted)
    observed_tokens = sum(v.tokens or 0 for v in counted)
    return {
        "complete": plan is not None and run_complete(counted, plan),
        "plan_sha256": plan.digest() if plan is not None else None,
        "shards": len(verdicts),
        "shards_counted": len(counted),
        "planned_tokens": plan.capture.planned_tokens if plan is not None else None,
        "planned_sparse_upper_bytes": plan.estimate.sparse_upper_bytes if plan is not None else None,
        "planned_dense_bytes": plan.estimate.dense_bytes if plan is not None else None,
        "bytes_per_token": {**_planned_per_token(plan), **_observed(observed_bytes, observed_tokens)},
        "problems": problems,
    }
