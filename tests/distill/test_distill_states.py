"""State skips, contiguous exactly-once consumption, chained expert replay."""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil

import pytest

from kiln.distill import shards
from kiln.distill.contract import ConsumptionEvent, Plan, ShardManifest
from kiln.distill.errors import DistillError, LedgerError, TransitionError
from kiln.distill.ledger import Ledger, check_ledger
from kiln.distill.states import (
    EXAMPLE_TERMINAL,
    EXAMPLE_TRANSITIONS,
    SHARD_TRANSITIONS,
    advance_example,
    advance_shard,
    check_manifest_chain,
    check_manifest_step,
)

from tests.distill.conftest import FIXTURES

CKPT = hashlib.sha256(b"checkpoint").hexdigest()


def _manifest(shard: str, name: str) -> ShardManifest:
    return ShardManifest.parse((FIXTURES / shard / "manifests" / name).read_bytes())


def _available(shard: str = "shard-student-rollout") -> ShardManifest:
    return _manifest(shard, "3-available.json")


ROLLOUT_SHARD = FIXTURES / "shard-student-rollout"
EXPERT_SHARD = FIXTURES / "shard-teacher-expert"


def test_example_lifecycle_forward_steps() -> None:
    state = "proposed"
    for nxt in ("probed", "captured", "verified", "admitted"):
        state = advance_example(state, nxt)
    assert state == "admitted"


@pytest.mark.parametrize(
    "current,nxt",
    [("proposed", "captured"), ("probed", "verified"), ("captured", "admitted"), ("proposed", "admitted"),
     ("verified", "probed")],
)
def test_example_skips_fail(current: str, nxt: str) -> None:
    with pytest.raises(TransitionError, match="skipped"):
        advance_example(current, nxt)


@pytest.mark.parametrize("terminal", sorted(EXAMPLE_TERMINAL))
def test_example_terminal_records_are_final(terminal: str) -> None:
    assert terminal in {"admitted", "rejected", "quarantined"}
    with pytest.raises(TransitionError, match="terminal"):
        advance_example(terminal, "proposed")


# The spec's diagram, read column by column (docs/distill.md, "Example lifecycle"):
#   proposed -> probed -> captured -> verified -> admitted
#                 |          |            -> rejected
#                 |          -> quarantined
#                 -> rejected / quarantined
SPEC_EXAMPLE_EDGES = {
    ("proposed", "probed"),
    ("probed", "captured"), ("probed", "rejected"), ("probed", "quarantined"),
    ("captured", "verified"), ("captured", "quarantined"),
    ("verified", "admitted"), ("verified", "rejected"),
}
EXAMPLE_STATES = ["proposed", "probed", "captured", "verified", "admitted", "rejected", "quarantined"]


def test_example_table_is_exactly_the_spec_diagram() -> None:
    assert set(EXAMPLE_TRANSITIONS) == set(EXAMPLE_STATES)
    assert {(a, b) for a, nxt in EXAMPLE_TRANSITIONS.items() for b in nxt} == SPEC_EXAMPLE_EDGES
    assert EXAMPLE_TERMINAL == {"admitted", "rejected", "quarantined"}


@pytest.mark.parametrize("current,nxt", sorted(SPEC_EXAMPLE_EDGES))
def test_example_edges_of_the_diagram_are_allowed(current: str, nxt: str) -> None:
    assert advance_example(current, nxt) == nxt


@pytest.mark.parametrize(
    "current,nxt", [p for p in itertools.product(EXAMPLE_STATES, repeat=2) if p not in SPEC_EXAMPLE_EDGES]
)
def test_every_edge_missing_from_the_diagram_is_forbidden(current: str, nxt: str) -> None:
    # 49 ordered pairs, 8 edges: the other 41 (including the four the old table
    # allowed: proposed->rejected/quarantined, captured->rejected,
    # verified->quarantined) all raise.
    with pytest.raises(TransitionError):
        advance_example(current, nxt)


SPEC_SHARD_EDGES = {
    ("staging", "complete"), ("complete", "verified"), ("verified", "available"),
    ("staging", "quarantined"), ("complete", "quarantined"), ("verified", "quarantined"),
    ("available", "quarantined"),
}
SHARD_STATES = ["staging", "complete", "verified", "available", "quarantined"]


@pytest.mark.parametrize("current,nxt", list(itertools.product(SHARD_STATES, repeat=2)))
def test_shard_edges_are_exactly_the_spec_diagram(current: str, nxt: str) -> None:
    assert {(a, b) for a, n in SHARD_TRANSITIONS.items() for b in n} == SPEC_SHARD_EDGES
    if (current, nxt) in SPEC_SHARD_EDGES:
        assert advance_shard(current, nxt) == nxt
    else:
        with pytest.raises(TransitionError):
            advance_shard(current, nxt)


@pytest.mark.parametrize(
    "current,nxt",
    [("staging", "verified"), ("staging", "available"), ("complete", "available"), ("available", "staging"),
     ("quarantined", "available")],
)
def test_shard_skips_fail(current: str, nxt: str) -> None:
    with pytest.raises(TransitionError):
        advance_shard(current, nxt)


def test_shard_states_can_always_be_quarantined() -> None:
    for state in ("staging", "complete", "verified", "available"):
        assert advance_shard(state, "quarantined") == "quarantined"


def test_fixture_manifest_chain_is_valid_and_binds_predecessors() -> None:
    names = ["0-staging.json", "1-complete.json", "2-verified.json", "3-available.json"]
    chain = [_manifest("shard-teacher-expert", n) for n in names]
    assert check_manifest_chain(chain).state == "available"
    with pytest.raises(TransitionError, match="skipped"):
        check_manifest_chain([chain[0], chain[2]])
    forged = ShardManifest.parse(dict(chain[3].to_obj(), previous_manifest_sha256=chain[1].digest()))
    with pytest.raises(TransitionError, match="canonical hash"):
        check_manifest_step(chain[2], forged)
    swapped = ShardManifest.parse(dict(chain[3].to_obj(), previous_manifest_sha256=chain[2].digest(),
                                       payloads=[dict(chain[3].payloads[0].to_obj(), sha256="0" * 64)]))
    with pytest.raises(TransitionError, match="alters payload"):
        check_manifest_step(chain[2], swapped)


# ------------------------------------------------------------------ consumption


def test_fixture_ledger_is_reserve_then_commit(rollout_plan) -> None:
    events = [ConsumptionEvent.parse(l) for l in
              (FIXTURES / "ledger-student-rollout.jsonl").read_bytes().split(b"\n")[:-1]]
    assert [e.action for e in events] == ["reserve", "commit"]
    view = check_ledger(events, artifact_sha256=_available().digest(), policy=rollout_plan.consumption)
    assert view.state == "committed" and view.commits == 1 and view.next_sequence == 2


def test_student_rollout_is_consumed_exactly_once(tmp_path, rollout_plan) -> None:
    ledger = Ledger(tmp_path / "ledger.jsonl", ROLLOUT_SHARD, rollout_plan)
    ledger.reserve("run-a", "r0")
    ledger.release()  # crash before a durable checkpoint: back to available
    ledger.reserve("run-a", "r1")
    ledger.commit(CKPT)
    with pytest.raises(LedgerError, match="consume-once"):
        ledger.replay("run-b", "r2")
    with pytest.raises(DistillError, match="replay_of"):
        ledger.reserve("run-b", "r3")  # a plain reserve after a commit is not a step
    reopened = Ledger(tmp_path / "ledger.jsonl", ROLLOUT_SHARD, rollout_plan)
    assert [e.sequence for e in reopened.events] == [0, 1, 2, 3]
    assert reopened.view.commits == 1


def test_ledger_rules_on_raw_events(rollout_plan) -> None:
    events = [ConsumptionEvent.parse(l) for l in
              (FIXTURES / "ledger-student-rollout.jsonl").read_bytes().split(b"\n")[:-1]]
    art, pol = _available().digest(), rollout_plan.consumption
    gap = ConsumptionEvent.parse(dict(events[1].to_obj(), sequence=2))
    with pytest.raises(LedgerError, match="contiguous"):
        check_ledger([events[0], gap], artifact_sha256=art, policy=pol)
    with pytest.raises(LedgerError, match="contiguous"):
        check_ledger([events[1]], artifact_sha256=art, policy=pol)
    with pytest.raises(LedgerError, match="another artifact"):
        check_ledger(events, artifact_sha256="f" * 64, policy=pol)
    other_view = [ConsumptionEvent.parse(dict(e.to_obj(), view="teacher-expert")) for e in events]
    with pytest.raises(LedgerError, match="view"):
        check_ledger(other_view, artifact_sha256=art, policy=pol)
    stolen = ConsumptionEvent.parse(dict(events[1].to_obj(), reservation_id="someone-else"))
    with pytest.raises(LedgerError, match="open reservation"):
        check_ledger([events[0], stolen], artifact_sha256=art, policy=pol)
    backwards = ConsumptionEvent.parse(dict(events[1].to_obj(), prior_state="available", next_state="committed"))
    with pytest.raises(LedgerError, match="starts from"):
        check_ledger([events[0], backwards], artifact_sha256=art, policy=pol)


def test_commit_requires_checkpoint_and_reservation(tmp_path, rollout_plan) -> None:
    ledger = Ledger(tmp_path / "l.jsonl", ROLLOUT_SHARD, rollout_plan)
    with pytest.raises(LedgerError, match="no reservation"):
        ledger.commit(CKPT)
    ledger.reserve("run", "r0")
    with pytest.raises(Exception, match="checkpoint_sha256"):
        ledger.commit("not-a-hash")
    ledger.release()
    with pytest.raises(LedgerError, match="reuses"):
        ledger.reserve("run", "r0")


def test_reconcile_after_crash_appends_exactly_one_commit(tmp_path, rollout_plan) -> None:
    path = tmp_path / "l.jsonl"
    Ledger(path, ROLLOUT_SHARD, rollout_plan).reserve("run", "r0")
    ledger = Ledger(path, ROLLOUT_SHARD, rollout_plan)  # the process restarted
    assert ledger.reconcile(CKPT).action == "commit"
    assert Ledger(path, ROLLOUT_SHARD, rollout_plan).reconcile(CKPT) is None
    with pytest.raises(LedgerError, match="nothing to reconcile"):
        Ledger(path, ROLLOUT_SHARD, rollout_plan).reconcile("e" * 64)
    assert len(path.read_bytes().splitlines()) == 2


def test_only_available_shards_can_be_reserved(tmp_path, rollout_plan) -> None:
    unpublished = tmp_path / "shard"
    shutil.copytree(ROLLOUT_SHARD, unpublished)
    (unpublished / "manifests" / "3-available.json").unlink()  # the registry says: verified
    with pytest.raises(LedgerError, match="only an available shard"):
        Ledger(tmp_path / "unused.jsonl", unpublished, rollout_plan)
    assert not (tmp_path / "unused.jsonl").exists()


def test_a_quarantined_shard_cannot_be_reserved_through_a_stale_view(tmp_path, expert_plan) -> None:
    shard = tmp_path / "shard"
    shutil.copytree(EXPERT_SHARD, shard)
    stale = Ledger(tmp_path / "l.jsonl", shard, expert_plan)  # opened while available
    stale.reserve("run", "r0")
    stale.release()
    shards.quarantine(shard, "payload bit rot found after publication")
    with pytest.raises(LedgerError, match="registry now records .* 'quarantined'"):
        stale.reserve("run", "r1")
    reopened = Ledger(tmp_path / "l.jsonl", shard, expert_plan)  # the ledger's history stays readable
    with pytest.raises(LedgerError, match="quarantined.*bit rot"):
        reopened.reserve("run", "r1")
    assert [e.action for e in reopened.events] == ["reserve", "release"]
    assert len((tmp_path / "l.jsonl").read_bytes().splitlines()) == 2


def test_a_reservation_open_at_quarantine_can_still_close(tmp_path, expert_plan) -> None:
    """Release/commit record what already happened; only new reservations need an available shard."""
    shard = tmp_path / "shard"
    shutil.copytree(EXPERT_SHARD, shard)
    ledger = Ledger(tmp_path / "l.jsonl", shard, expert_plan)
    ledger.reserve("run", "r0")
    shards.quarantine(shard, "bit rot")
    assert ledger.release().action == "release"


def test_consumption_under_another_plan_is_refused(tmp_path, rollout_plan) -> None:
    with pytest.raises(LedgerError, match="mixed run"):
        Ledger(tmp_path / "l.jsonl", EXPERT_SHARD, rollout_plan)
    assert not (tmp_path / "l.jsonl").exists()


def test_teacher_expert_replay_is_chained_to_the_prior_commit(tmp_path, expert_plan) -> None:
    avail = _available("shard-teacher-expert")
    ledger = Ledger(tmp_path / "l.jsonl", EXPERT_SHARD, expert_plan)
    ledger.reserve("run", "r0")
    first = ledger.commit(CKPT)
    replay = ledger.replay("run", "r1")
    assert replay.replay_of == first.digest() and replay.prior_state == "committed"
    second = ledger.commit(hashlib.sha256(b"ckpt2").hexdigest())
    view = check_ledger(ledger.events, artifact_sha256=avail.digest(), policy=expert_plan.consumption)
    assert view.commits == 2 and view.last_commit_sha256 == second.digest()
    # A replay naming anything but the latest commit is refused.
    stale = ConsumptionEvent.parse(dict(replay.to_obj(), sequence=4, reservation_id="r2"))
    with pytest.raises(LedgerError, match="last commit"):
        check_ledger([*ledger.events, stale], artifact_sha256=avail.digest(), policy=expert_plan.consumption)


def test_teacher_expert_replay_needs_a_chained_policy(tmp_path, expert_plan, expert_rows) -> None:
    obj = expert_plan.to_obj()
    plan = Plan.parse(dict(obj, consumption=dict(obj["consumption"], replay="forbidden")))
    shard = shards.capture_shard(tmp_path / "root", plan, "s0", "t0", {"rows-00000.jsonl": expert_rows})
    ledger = Ledger(tmp_path / "l.jsonl", shard, plan)
    ledger.reserve("run", "r0")
    ledger.commit(CKPT)
    with pytest.raises(LedgerError, match="forbids replay"):
        ledger.replay("run", "r1")


def test_teacher_expert_second_consumption_needs_replay_of_even_after_a_release(tmp_path, expert_plan) -> None:
    """reserve, commit, replay, release, plain reserve: the plain reserve is refused."""
    ledger = Ledger(tmp_path / "l.jsonl", EXPERT_SHARD, expert_plan)
    ledger.reserve("run", "r0")
    first = ledger.commit(CKPT)
    ledger.replay("run", "r1")
    ledger.release()  # crash during the replay's training: the view is available again ...
    assert ledger.view.state == "available" and ledger.view.commits == 1
    with pytest.raises(LedgerError, match="already committed.*replay_of"):
        ledger.reserve("run", "r2")  # ... but its history holds a commit
    assert len(ledger.events) == 4
    again = ledger.replay("run", "r3")  # a second consumption is only a chained replay
    assert again.replay_of == first.digest() and again.prior_state == "available" and again.action == "replay"
    ledger.commit(hashlib.sha256(b"ckpt2").hexdigest())
    assert Ledger(tmp_path / "l.jsonl", EXPERT_SHARD, expert_plan).view.commits == 2


def test_laundered_second_consumption_is_refused_on_raw_events(tmp_path, expert_plan) -> None:
    """The rule lives in the ledger check itself, not only in the ``Ledger`` helpers."""
    ledger = Ledger(tmp_path / "l.jsonl", EXPERT_SHARD, expert_plan)
    ledger.reserve("run", "r0")
    commit = ledger.commit(CKPT)
    ledger.replay("run", "r1")
    ledger.release()
    art, pol = _available("shard-teacher-expert").digest(), expert_plan.consumption
    base = {**ledger.events[0].to_obj(), "sequence": 4, "reservation_id": "r2"}
    plain = ConsumptionEvent.parse(base)
    with pytest.raises(LedgerError, match="already committed"):
        check_ledger([*ledger.events, plain], artifact_sha256=art, policy=pol)
    wrong = ConsumptionEvent.parse(dict(base, replay_of="c" * 64))
    with pytest.raises(LedgerError, match="last commit"):
        check_ledger([*ledger.events, wrong], artifact_sha256=art, policy=pol)
    chained = ConsumptionEvent.parse(dict(base, replay_of=commit.digest()))
    assert check_ledger([*ledger.events, chained], artifact_sha256=art, policy=pol).state == "reserved"
    # Before any commit, a reservation may not claim to replay one.
    with pytest.raises(LedgerError, match="nothing has been committed"):
        check_ledger([ConsumptionEvent.parse(dict(ledger.events[0].to_obj(), replay_of=commit.digest()))],
                     artifact_sha256=art, policy=pol)
    with pytest.raises(LedgerError, match="nothing has been committed"):
        Ledger(tmp_path / "fresh.jsonl", EXPERT_SHARD, expert_plan).replay("run", "r0")


def test_tampered_ledger_file_is_refused(tmp_path, rollout_plan) -> None:
    path = tmp_path / "l.jsonl"
    raw = (FIXTURES / "ledger-student-rollout.jsonl").read_bytes()
    path.write_bytes(raw.replace(b"\n", b"\r\n"))
    with pytest.raises(LedgerError, match="not canonical"):
        Ledger(path, ROLLOUT_SHARD, rollout_plan)
    lines = raw.split(b"\n")[:-1]
    path.write_bytes(lines[1] + b"\n")
    with pytest.raises(LedgerError, match="contiguous"):
        Ledger(path, ROLLOUT_SHARD, rollout_plan)
    obj = json.loads(lines[0])
    assert obj["sequence"] == 0
