"""Where consumption state lives: beside the capture artifact, keyed by the artifact and its rows.

The spec: "Consumption is an append-only ledger over an immutable source artifact", and
student-rollout trajectories are consume-once. That state belongs to the artifact, not to
whichever trainer reads it, so every consumer (``kiln distill train`` from any output
directory, the server's KD jobs for any adapter) reads and appends the same files::

    <capture root>/.consumption/
        .lock                           flock held while a reservation is checked and appended
        <transaction_id>.jsonl          the artifact's ledger (consumption-event.v1 rows)
        <transaction_id>.rows.json      the rows it covers: example IDs (+ the rollout checkpoint)

Rows follow their identity across recaptures: a shard recaptured under a new transaction
(``.t001``) is a new artifact with a new ledger, but its rows claim the same example IDs,
so it cannot be reserved while another artifact holding one of them is reserved or
committed. The rows file is written once (atomic) before the artifact's first reservation;
reservations are checked and appended under the root's lock, so two trainers cannot claim
one row at once. ``.consumption`` is a dot directory: shard scanners never read it.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kiln.canonical import atomic_write_bytes, canonical_json_bytes, read_regular_file, strict_json_loads
from kiln.distill.contract import Plan
from kiln.distill.errors import LedgerError
from kiln.distill.ledger import MAX_LEDGER_BYTES, Ledger
from kiln.distill.paths import read_bytes_nofollow

__all__ = ["CONSUMPTION_DIRNAME", "ROWS_SCHEMA", "consumption_dir", "artifact_ledger", "adopt_legacy_ledger"]

CONSUMPTION_DIRNAME = ".consumption"
ROWS_SCHEMA = "kiln.distill.consumption-rows.v1"
_MAX_ROWS_FILE_BYTES = 64 << 20


def consumption_dir(run_root: str | os.PathLike[str]) -> Path:
    return Path(run_root) / CONSUMPTION_DIRNAME


@contextmanager
def _root_lock(base: Path) -> Iterator[None]:
    fd = os.open(base / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _rows_doc(base: Path, name: str) -> dict:
    doc = strict_json_loads(read_bytes_nofollow(base, name, max_bytes=_MAX_ROWS_FILE_BYTES))
    if not isinstance(doc, dict) or doc.get("schema") != ROWS_SCHEMA or not isinstance(doc.get("example_ids"), list):
        raise LedgerError(f"{base / name} is not a {ROWS_SCHEMA} document")
    return doc


class ArtifactLedger(Ledger):
    """The ledger of one published shard, stored beside the capture, whose reservations also check
    that no other artifact holding one of its rows is reserved or committed."""

    def __init__(self, run_root: Path, shard_dir: Path, plan: Plan, transaction_id: str):
        self.base = consumption_dir(run_root)
        self.base.mkdir(exist_ok=True)
        self.transaction_id = transaction_id
        self.plan = plan
        super().__init__(self.base / f"{transaction_id}.jsonl", shard_dir, plan)
        self._example_ids: list[str] | None = None

    @property
    def example_ids(self) -> list[str]:
        """The example IDs the artifact's committed payloads hold (read once, hashes re-checked)."""
        if self._example_ids is None:
            self._example_ids = shard_example_ids(self.shard_dir)
        return self._example_ids

    def _rows_name(self, transaction_id: str) -> str:
        return f"{transaction_id}.rows.json"

    def _write_rows(self) -> None:
        name = self._rows_name(self.transaction_id)
        doc = {
            "schema": ROWS_SCHEMA,
            "artifact_sha256": self.artifact_sha256,
            "transaction_id": self.transaction_id,
            "plan_sha256": self.plan.digest(),
            "trajectory": self.policy.trajectory,
            "rollout_checkpoint_sha256": self.policy.rollout_checkpoint_sha256,
            "example_ids": self.example_ids,
        }
        if (self.base / name).exists():
            if _rows_doc(self.base, name) != doc:
                raise LedgerError(f"{self.base / name} records other rows for this transaction; refusing to consume")
            return
        atomic_write_bytes(self.base / name, canonical_json_bytes(doc))

    def _check_rows_unclaimed(self) -> None:
        """No other artifact of this root holding one of these rows may be reserved or committed."""
        mine = set(self.example_ids)
        for path in sorted(self.base.glob("*.rows.json")):
            if path.name == self._rows_name(self.transaction_id):
                continue
            other = _rows_doc(self.base, path.name)
            shared = sorted(mine.intersection(other["example_ids"]))
            if not shared:
                continue
            ledger_path = self.base / f"{other['transaction_id']}.jsonl"
            if not ledger_path.exists():
                continue
            raw = read_bytes_nofollow(self.base, ledger_path.name, max_bytes=MAX_LEDGER_BYTES)
            events = [strict_json_loads(line) for line in raw.splitlines() if line]
            state = events[-1]["next_state"] if events else "available"
            committed = any(e.get("checkpoint_sha256") for e in events)
            if committed or state == "reserved":
                raise LedgerError(
                    f"rows {shared[:3]} of {self.transaction_id} were already "
                    f"{'consumed' if committed else 'reserved'} through artifact {other['artifact_sha256']} "
                    f"({other['transaction_id']}); consumption follows the rows: a recaptured shard is not "
                    "consumed again (student-rollout rows are consume-once; replay goes through the first ledger)"
                )

    def _append(self, **fields: object):  # type: ignore[no-untyped-def]
        # Every append runs under the root's lock, so two consumers never interleave a read and a write
        # of one ledger; a reservation also claims its rows there.
        with _root_lock(self.base):
            if fields["next_state"] == "reserved":
                self._write_rows()
                self._check_rows_unclaimed()
            return super()._append(**fields)


def adopt_legacy_ledger(legacy: Path, ledger_path: Path) -> None:
    """Carry a ledger written by an older Kiln under a trainer's own folder to the artifact's place.

    Missing there: copied (atomic). Present: the legacy ledger must be a prefix of it (nothing it
    recorded may be lost), else consumption is refused rather than guessed.
    """
    if not legacy.is_file() or legacy.is_symlink():
        return
    old = read_regular_file(legacy, MAX_LEDGER_BYTES)
    if not ledger_path.exists():
        ledger_path.parent.mkdir(exist_ok=True)
        atomic_write_bytes(ledger_path, old)
        return
    if not read_regular_file(ledger_path, MAX_LEDGER_BYTES).startswith(old):
        raise LedgerError(
            f"{legacy} (a ledger from an older Kiln) records consumption that the capture's ledger {ledger_path} "
            "does not; reconcile them by hand before training"
        )


def shard_example_ids(shard_dir: Path) -> list[str]:
    """Example IDs of a published shard's committed payloads, in order (each payload's SHA-256 re-checked)."""
    from kiln.canonical import sha256_hex
    from kiln.distill.binary import PACKED_SUFFIX, packed_trajectories
    from kiln.distill.shard_verify import MAX_PAYLOAD_BYTES, parse_payload, read_chain

    ids: list[str] = []
    for p in read_chain(shard_dir)[-1].payloads:
        raw = read_bytes_nofollow(shard_dir, p.path, max_bytes=MAX_PAYLOAD_BYTES)
        if sha256_hex(raw) != p.sha256:
            raise LedgerError(f"{shard_dir.name}/{p.path} differs from its commitment; refusing to consume it")
        if p.path.endswith(PACKED_SUFFIX):
            ids += [t[0] for t in packed_trajectories(raw, p.path)]
        else:
            ids += list(dict.fromkeys(r.example_id for r in parse_payload(raw, p.path)))
    return ids


def artifact_ledger(run_root: str | os.PathLike[str], shard_dir: Path, plan: Plan, transaction_id: str) -> ArtifactLedger:
    """The one ledger of the artifact published at ``shard_dir`` of the capture at ``run_root``."""
    return ArtifactLedger(Path(run_root), Path(shard_dir), plan, transaction_id)
