"""Spec deviations round 3 (issue 33), rank-population law side. Each test quotes the clause
of shared/spec/rank-population-law.txt it enforces."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.cluster import acquire
from kiln.cluster.acquire import (
    AcquisitionOutcome,
    RankPopulationReceipt,
    ReceiptForgeryError,
    WorldPlan,
    acquire_rank_population,
)
from kiln.cluster.cli import app
from kiln.system import ranks
from kiln.system.ranks import ObservationInputError, decide_rank_population, parse_observation_json
from tests.cluster.test_rank_law_witnesses import INCARNATION, _participant, observed_shape


def decide(obs: dict[str, Any]):
    return decide_rank_population(parse_observation_json(json.dumps(obs).encode()))


# ---- item 6 -------------------------------------------------------------------------------
# "The selected hosts are distinct identities. Both directions of the host join are existence
#  checks, so [A, A] with both ranks on A passed every one of them — a single machine presenting
#  as a pair, with the two-host claim resting on list multiplicity standing in for host identity."


@pytest.mark.parametrize("alias", ["SPARK-3BD5", "spark-3bd5.", "Spark-3bd5."])
def test_one_machine_spelled_two_ways_is_not_a_pair(alias):
    obs = observed_shape()
    obs["selected_hosts"] = ["spark-3bd5", alias]
    obs["participants"] = [_participant(0, "spark-3bd5", "46055"), _participant(1, alias, "3764")]
    decision = decide(obs)
    assert decision.to_json_dict()["findings"] == [
        {"kind": "selected_host_named_more_than_once", "host": "spark-3bd5", "occurrences": 2}
    ]


def test_the_same_host_spelled_differently_on_each_side_of_the_join_is_one_host():
    # positive control: case and the DNS root dot do not make a participant "unselected"
    obs = observed_shape()
    obs["selected_hosts"] = ["spark-3bd5", "spark-a3ee"]
    obs["participants"] = [_participant(0, "SPARK-3BD5.", "46055"), _participant(1, "Spark-A3EE", "3764")]
    assert decide(obs).coherent


def test_ranks_on_one_host_spelled_two_ways_share_its_process_keys():
    # "Process keys are host-local": the same pid on the same machine is one process, however spelled.
    obs = observed_shape()
    obs["participants"] = [_participant(0, "host-a", "46055"), _participant(1, "HOST-A", "46055")]
    kinds = decide(obs).kinds
    assert "ranks_share_host_local_worker_process_key" in kinds


@pytest.mark.parametrize(
    "bad", [" spark-3bd5", "spark-3bd5 ", "spark 3bd5", "spark-3bd5\n", "spark\x00", "spark\t3bd5", "a..b", ".", ""]
)
@pytest.mark.parametrize("where", ["selected", "participant"])
def test_invalid_host_names_are_input_errors(bad, where):
    obs = observed_shape()
    if where == "selected":
        obs["selected_hosts"] = [bad, "host-b"]
    else:
        obs["participants"][0]["host"] = bad
    with pytest.raises(ObservationInputError):
        parse_observation_json(json.dumps(obs).encode())
    with pytest.raises(ValueError):
        ranks.canonical_host(bad)


def test_ip_literals_are_compared_in_canonical_form():
    obs = observed_shape()
    obs["selected_hosts"] = ["192.168.102.10", "fe80::1"]
    obs["participants"] = [_participant(0, "192.168.102.10", "1"), _participant(1, "[FE80:0:0::1]", "2")]
    assert decide(obs).coherent


def test_ranks_check_cli_refuses_an_invalid_host_with_exit_2(tmp_path):
    obs = observed_shape()
    obs["selected_hosts"] = ["host-a\n", "host-b"]
    path = tmp_path / "obs.json"
    path.write_text(json.dumps(obs))
    res = CliRunner().invoke(app, ["check", str(path)])
    assert res.exit_code == 2 and res.stdout == ""


# ---- item B -------------------------------------------------------------------------------
# "A later host adapter supplies real participants, and only that adapter joined to a coherent
#  decision may mint a production receipt." A receipt proves that this process's
#  acquire_rank_population acquired exactly its record and observation (docs/cluster.md).


@pytest.fixture(scope="module")
def genuine() -> AcquisitionOutcome:
    # The selected host is this machine spelled in capitals with the DNS root dot (item 6 in a real world).
    outcome = acquire_rank_population(
        WorldPlan(nproc_per_host=1, selected_hosts=(socket.gethostname().upper() + ".",), timeout_s=30)
    )
    assert outcome is not None
    return outcome


def test_a_real_world_on_a_differently_spelled_selected_host_is_coherent(genuine):
    assert genuine.decision.coherent, genuine.decision.to_json_dict()
    receipt = genuine.receipt()
    assert receipt.coherent and receipt.observation == genuine.observation


def test_no_module_attribute_mints_a_receipt_by_keyword(genuine):
    rec, obs, dec = genuine.acquisition, genuine.observation, genuine.decision
    for name in dir(acquire):
        token = getattr(acquire, name)
        for cls in (RankPopulationReceipt, AcquisitionOutcome):
            with pytest.raises((ReceiptForgeryError, TypeError)):
                cls(rec, obs, dec, _mint=token)


def _forge(cls, sealed) -> Any:
    forged = object.__new__(cls)
    object.__setattr__(forged, "_sealed", sealed)
    return forged


def _assert_unusable(forged) -> None:
    for use in (lambda r: r.coherent, lambda r: r.observation, lambda r: r.acquisition, lambda r: r.decision,
                lambda r: r.to_json_dict(), lambda r: hash(r), lambda r: r == r):
        with pytest.raises(ReceiptForgeryError):
            use(forged)


def test_object_new_and_setattr_do_not_make_a_usable_receipt(genuine):
    rec, obs, dec = genuine.acquisition, genuine.observation, genuine.decision
    _assert_unusable(object.__new__(RankPopulationReceipt))  # nothing set at all
    _assert_unusable(_forge(RankPopulationReceipt, (rec, obs, dec, b"\x00" * 32)))
    _assert_unusable(_forge(RankPopulationReceipt, (rec, obs, dec)))


def test_a_genuine_seal_does_not_transfer_to_other_contents_or_another_type(genuine):
    receipt = genuine.receipt()
    rec, obs, dec, seal = object.__getattribute__(receipt, "_sealed")
    other = parse_observation_json(json.dumps({**observed_shape(), "incarnation": INCARNATION}).encode())
    _assert_unusable(_forge(RankPopulationReceipt, (rec, other, decide_rank_population(other), seal)))
    # an outcome's seal re-typed as a receipt
    _assert_unusable(_forge(RankPopulationReceipt, object.__getattribute__(genuine, "_sealed")))


def test_mutating_a_genuine_receipts_contents_in_place_voids_it():
    outcome = acquire_rank_population(WorldPlan(nproc_per_host=1, timeout_s=30))
    assert outcome is not None
    receipt = outcome.receipt()
    assert receipt.coherent
    object.__setattr__(receipt.observation, "incarnation", "another-engine")
    _assert_unusable(receipt)


def test_a_second_minting_authority_mints_nothing_this_module_accepts(genuine):
    _verify, _receipt_of, mint_outcome = acquire._minting_authority()
    fresh = mint_outcome(genuine.acquisition, genuine.observation, genuine.decision)
    _assert_unusable(fresh)
    with pytest.raises(ReceiptForgeryError):
        fresh.receipt()
