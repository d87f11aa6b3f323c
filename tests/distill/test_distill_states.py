"""State skips, contiguous exactly-once consumption, chained expert replay."""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln.distill.contract import ConsumptionEvent, ShardManifest
from kiln.distill.errors import DistillError, LedgerError, TransitionError
from kiln.distill.ledger import Ledger, check_ledger
from kiln.distill.states import (
    EXAMPLE_TERMINAL,
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


def test_any_live_example_can_be_rejected_or_quarantined() -> None:
    for state in ("proposed", "probed", "captured", "verified"):
        assert advance_example(state, "rejected") == "rejected"
        assert advance_example(state, "quarantined") == "quarantined"


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
    ledger = Ledger(tmp_path / "ledger.jsonl", _available(), rollout_plan.consumption)
    ledger.reserve("run-a", "r0")
    ledger.release()  # crash before a durable checkpoint: back to available
    ledger.reserve("run-a", "r1")
    ledger.commit(CKPT)
    with pytest.raises(LedgerError, match="consume-once"):
        ledger.replay("run-b", "r2")
    with pytest.raises(DistillError, match="replay_of"):
        ledger.reserve("run-b", "r3")  # a plain reserve after a commit is not a step
    reopened = Ledger(tmp_path / "ledger.jsonl", _available(), rollout_plan.consumption)
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
    ledger = Ledger(tmp_path / "l.jsonl", _available(), rollout_plan.consumption)
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
    Ledger(path, _available(), rollout_plan.consumption).reserve("run", "r0")
    ledger = Ledger(path, _available(), rollout_plan.consumption)  # the process restarted
    assert ledger.reconcile(CKPT).action == "commit"
    assert Ledger(path, _available(), rollout_plan.consumption).reconcile(CKPT) is None
    with pytest.raises(LedgerError, match="nothing to reconcile"):
        Ledger(path, _available(), rollout_plan.consumption).reconcile("e" * 64)
    assert len(path.read_bytes().splitlines()) == 2


def test_only_available_shards_can_be_reserved(rollout_plan) -> None:
    with pytest.raises(LedgerError, match="only an available shard"):
        Ledger("unused.jsonl", _manifest("shard-student-rollout", "2-verified.json"), rollout_plan.consumption)


def test_teacher_expert_replay_is_chained_to_the_prior_commit(tmp_path, expert_plan) -> None:
    avail = _available("shard-teacher-expert")
    ledger = Ledger(tmp_path / "l.jsonl", avail, expert_plan.consumption)
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


def test_teacher_expert_replay_needs_a_chained_policy(tmp_path, expert_plan) -> None:
    policy = expert_plan.consumption.model_copy(update={"replay": "forbidden"})
    ledger = Ledger(tmp_path / "l.jsonl", _available("shard-teacher-expert"), policy)
    ledger.reserve("run", "r0")
    ledger.commit(CKPT)
    with pytest.raises(LedgerError, match="forbids replay"):
        ledger.replay("run", "r1")


def test_tampered_ledger_file_is_refused(tmp_path, rollout_plan) -> None:
    path = tmp_path / "l.jsonl"
    raw = (FIXTURES / "ledger-student-rollout.jsonl").read_bytes()
    path.write_bytes(raw.replace(b"\n", b"\r\n"))
    with pytest.raises(LedgerError, match="not canonical"):
        Ledger(path, _available(), rollout_plan.consumption)
    lines = raw.split(b"\n")[:-1]
    path.write_bytes(lines[1] + b"\n")
    with pytest.raises(LedgerError, match="contiguous"):
        Ledger(path, _available(), rollout_plan.consumption)
    obj = json.loads(lines[0])
    assert obj["sequence"] == 0
