"""Append-only consumption ledger over one immutable, available shard.

The ledger file is canonical JSONL of ``ConsumptionEvent`` rows. Its rules:

* sequence numbers start at 0 and are contiguous;
* every event names the same artifact (the available manifest's hash) and view;
* each event's ``prior_state`` is the state the previous event left, and the step
  is one of reserve, release, commit or replay;
* release/commit close the open reservation with its own run and reservation IDs,
  and a commit carries the durable checkpoint SHA-256;
* reservation IDs are never reused;
* after a commit, a student-rollout view is finished; a teacher-expert view may be
  consumed again only through a replay: a reservation whose ``replay_of`` is the
  hash of the last commit event, allowed only when the plan says ``chained``.
  This holds for every later reservation, including one made after a replay
  reservation was released (the view is ``available`` again, but its history
  holds a commit), so release-then-reserve cannot launder a second consumption;
* only a shard whose *current* registry record (the head of its manifest chain
  on disk) is the available manifest may be reserved: a quarantine written
  after the ledger was opened is honoured by the next reservation;
* the consuming plan must be the shard's own plan: a mixed run is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

from kiln.canonical import (
    FileTooLargeError,
    JSONLNormalizationError,
    atomic_write_bytes,
    jsonl_c14n,
    read_regular_file,
)
from kiln.distill.contract import (
    CONSUMPTION_EVENT_SCHEMA,
    ConsumptionEvent,
    ConsumptionPolicy,
    Plan,
    ShardManifest,
)
from kiln.distill.errors import DistillError, LedgerError
from kiln.distill.shards import read_manifest_chain

__all__ = ["MAX_LEDGER_BYTES", "MAX_LEDGER_EVENTS", "LedgerView", "apply_event", "check_ledger", "Ledger"]

MAX_LEDGER_BYTES = 16 << 20
MAX_LEDGER_EVENTS = 100_000


@dataclass(frozen=True)
class LedgerView:
    """The state a ledger prefix leaves behind."""

    artifact_sha256: str
    view: str
    state: str = "available"
    next_sequence: int = 0
    open_reservation: tuple[str, str] | None = None  # (run_id, reservation_id)
    last_commit_sha256: str | None = None
    commits: int = 0
    reservation_ids: frozenset[str] = field(default_factory=frozenset)


def apply_event(view: LedgerView, event: ConsumptionEvent, policy: ConsumptionPolicy) -> LedgerView:
    """Return the view after ``event`` or raise ``LedgerError`` naming the broken rule."""
    where = f"event {event.sequence}"
    if event.artifact_sha256 != view.artifact_sha256:
        raise LedgerError(f"{where} names another artifact; one ledger covers one artifact")
    if event.view != view.view:
        raise LedgerError(f"{where} has view {event.view!r}; this ledger is {view.view!r}")
    if event.sequence != view.next_sequence:
        raise LedgerError(f"{where}: expected sequence {view.next_sequence}; the ledger must be contiguous from 0")
    if event.prior_state != view.state:
        raise LedgerError(f"{where} starts from {event.prior_state!r} but the artifact is {view.state!r}")
    action = event.action
    if action == "invalid":
        raise LedgerError(f"{where}: {event.prior_state!r} -> {event.next_state!r} is not a consumption step")
    base = replace(view, state=event.next_state, next_sequence=view.next_sequence + 1)
    if action in ("reserve", "replay"):
        if event.reservation_id in view.reservation_ids:
            raise LedgerError(f"{where} reuses reservation ID {event.reservation_id!r}")
        if view.commits:
            # A second consumption of committed data, whatever state the view is in now.
            if view.view == "student-rollout":
                raise LedgerError(
                    f"{where}: student-rollout data is consume-once; its prefixes are stale after a commit, "
                    "recapture from the new student instead"
                )
            if policy.replay != "chained":
                raise LedgerError(f"{where}: the plan's consumption policy forbids replay")
            if event.replay_of is None:
                raise LedgerError(
                    f"{where}: this artifact was already committed; a further consumption is only a replay "
                    f"reservation with replay_of = {view.last_commit_sha256} (the last commit event's hash)"
                )
            if event.replay_of != view.last_commit_sha256:
                raise LedgerError(f"{where}: replay_of must be the hash of the last commit event")
        elif event.replay_of is not None:
            raise LedgerError(f"{where}: replay_of names a commit, but nothing has been committed yet")
        return replace(
            base,
            open_reservation=(event.run_id, event.reservation_id),
            reservation_ids=view.reservation_ids | {event.reservation_id},
        )
    if view.open_reservation != (event.run_id, event.reservation_id):
        raise LedgerError(f"{where} ({action}) does not match the open reservation {view.open_reservation}")
    if action == "release":
        return replace(base, open_reservation=None)
    return replace(base, open_reservation=None, last_commit_sha256=event.digest(), commits=view.commits + 1)


def check_ledger(
    events: Iterable[ConsumptionEvent], *, artifact_sha256: str, policy: ConsumptionPolicy
) -> LedgerView:
    """Replay every event from the start and return the resulting view."""
    view = LedgerView(artifact_sha256=artifact_sha256, view=policy.trajectory)
    for event in events:
        view = apply_event(view, event, policy)
    return view


class Ledger:
    """File-backed ledger for one published shard, consumed under one plan.

    ``shard_dir`` is the shard's published transaction directory; its manifest
    chain on disk is the registry record. The ledger's artifact is the chain's
    available manifest. ``plan`` is the consumer's plan: it must be the shard's
    own (same ``plan_sha256``), and its consumption policy governs replay.
    Reservations re-read the chain from disk each time, so a shard quarantined
    after this object was built cannot be reserved through it.
    """

    def __init__(self, path: str | os.PathLike[str], shard_dir: str | os.PathLike[str], plan: Plan):
        self.path = Path(path)
        self.shard_dir = Path(shard_dir)
        self.policy: ConsumptionPolicy = plan.consumption
        chain = self._chain()
        head = chain[-1]
        if head.plan_sha256 != plan.digest():
            raise LedgerError(
                f"{self.shard_dir} belongs to plan {head.plan_sha256}, not this consumer's plan {plan.digest()}; "
                "a mixed run is refused: consume shards captured under your own plan"
            )
        published = [m for m in chain if m.state == "available"]
        if not published:
            raise LedgerError(
                f"only an available shard can be consumed; {self.shard_dir} is {head.state!r} and was never published"
            )
        self.artifact_sha256 = published[0].digest()
        self.events: list[ConsumptionEvent] = self._read()
        self.view = check_ledger(self.events, artifact_sha256=self.artifact_sha256, policy=self.policy)

    def _chain(self) -> list[ShardManifest]:
        try:
            return read_manifest_chain(self.shard_dir)
        except (DistillError, OSError) as exc:
            raise LedgerError(f"cannot read the registry record of {self.shard_dir}: {exc}") from exc

    def _check_reservable(self) -> None:
        """The durable record, read now, must still be this artifact's available manifest."""
        head = self._chain()[-1]
        if head.state != "available" or head.digest() != self.artifact_sha256:
            why = f" ({head.quarantine_reason})" if head.quarantine_reason else ""
            raise LedgerError(
                f"only available shards may be reserved; the registry now records {self.shard_dir} as "
                f"{head.state!r}{why}; capture a new shard instead"
            )

    def _raw(self) -> bytes:
        """The ledger's bytes (``b""`` when it does not exist yet): a regular file of at most
        ``MAX_LEDGER_BYTES`` (:func:`kiln.canonical.read_regular_file`), anything else a :class:`LedgerError`."""
        try:
            return read_regular_file(self.path, MAX_LEDGER_BYTES)
        except FileNotFoundError:
            return b""
        except FileTooLargeError:
            raise LedgerError(f"{self.path} is over the {MAX_LEDGER_BYTES}-byte ledger limit") from None
        except OSError as exc:
            raise LedgerError(f"{self.path} cannot be read: {exc.strerror or exc}") from None

    def _read(self) -> list[ConsumptionEvent]:
        raw = self._raw()
        if not raw:
            return []
        try:
            digest = jsonl_c14n(raw, max_rows=MAX_LEDGER_EVENTS)
        except JSONLNormalizationError as exc:
            raise LedgerError(f"{self.path}: {exc}") from exc
        if digest.normalized != raw:
            raise LedgerError(f"{self.path} is not canonical JSONL; ledgers are written only by Kiln")
        return [ConsumptionEvent.parse(obj) for obj in digest.objects()]

    def _append(self, **fields: object) -> ConsumptionEvent:
        if fields["next_state"] == "reserved":
            self._check_reservable()
        event = ConsumptionEvent.parse(
            {
                "schema": CONSUMPTION_EVENT_SCHEMA,
                "artifact_sha256": self.artifact_sha256,
                "view": self.policy.trajectory,
                "sequence": self.view.next_sequence,
                "prior_state": self.view.state,
                "checkpoint_sha256": None,
                "replay_of": None,
                **fields,
            }
        )
        view = apply_event(self.view, event, self.policy)
        on_disk = self._raw()
        if on_disk != b"".join(e.canonical_bytes() + b"\n" for e in self.events):
            raise LedgerError(f"{self.path} changed under this process; reopen the ledger")
        atomic_write_bytes(self.path, on_disk + event.canonical_bytes() + b"\n")
        self.events.append(event)
        self.view = view
        return event

    def reserve(self, run_id: str, reservation_id: str) -> ConsumptionEvent:
        return self._append(next_state="reserved", run_id=run_id, reservation_id=reservation_id)

    def release(self) -> ConsumptionEvent:
        run_id, reservation_id = self._open("release")
        return self._append(next_state="available", run_id=run_id, reservation_id=reservation_id)

    def commit(self, checkpoint_sha256: str) -> ConsumptionEvent:
        run_id, reservation_id = self._open("commit")
        return self._append(
            next_state="committed", run_id=run_id, reservation_id=reservation_id, checkpoint_sha256=checkpoint_sha256
        )

    def replay(self, run_id: str, reservation_id: str) -> ConsumptionEvent:
        if self.view.last_commit_sha256 is None:
            raise LedgerError("cannot replay: nothing has been committed yet; make a plain reservation")
        return self._append(
            next_state="reserved",
            run_id=run_id,
            reservation_id=reservation_id,
            replay_of=self.view.last_commit_sha256,
        )

    def reconcile(self, checkpoint_sha256: str) -> ConsumptionEvent | None:
        """After a crash between a durable checkpoint and its ledger commit.

        Appends exactly one commit if a reservation is still open; returns ``None``
        if the last event already commits this exact checkpoint; refuses otherwise.
        """
        if self.view.state == "reserved":
            return self.commit(checkpoint_sha256)
        last = self.events[-1] if self.events else None
        if last is not None and last.action == "commit" and last.checkpoint_sha256 == checkpoint_sha256:
            return None
        raise LedgerError("nothing to reconcile: no open reservation and no commit of this checkpoint")

    def _open(self, action: str) -> tuple[str, str]:
        if self.view.open_reservation is None:
            raise LedgerError(f"cannot {action}: no reservation is open")
        return self.view.open_reservation

