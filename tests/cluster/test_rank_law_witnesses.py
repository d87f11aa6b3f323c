"""The witness matrix of the rank-population law.

One positive control (the shape read off a live two-host TP=2 pair) and one
named test per discriminating case. Every refusal asserts the *exact* list of
findings, so a law that refuses everything fails the control and a law that
reports too much or too little fails the refusals.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kiln.system.ranks import (
    FINDING_KINDS,
    RankPopulationDecision,
    decide_rank_population,
    parse_observation_json,
)

INCARNATION = "engine-7f3a"


def observed_shape() -> dict[str, Any]:
    """world_size=2, TP 2 / PP 1 / DP 1, rank 0 on host-a (pid 46055), rank 1 on host-b (pid 3764)."""
    return {
        "incarnation": INCARNATION,
        "returned_completely": True,
        "world_size": 2,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "selected_hosts": ["host-a", "host-b"],
        "participants": [
            _participant(0, "host-a", "46055"),
            _participant(1, "host-b", "3764"),
        ],
    }


def _participant(rank: int, host: str, key: str, *, tp: int | None = None, inc: str = INCARNATION) -> dict[str, Any]:
    return {
        "global_rank": rank,
        "tensor_parallel_rank": rank if tp is None else tp,
        "host": host,
        "host_local_worker_process_key": key,
        "incarnation": inc,
    }


def decide(obs: dict[str, Any]) -> RankPopulationDecision:
    return decide_rank_population(parse_observation_json(json.dumps(obs).encode()))


def findings(obs: dict[str, Any]) -> list[dict[str, Any]]:
    decision = decide(obs)
    assert decision.decision == "refused", "expected a refusal"
    return decision.to_json_dict()["findings"]


# ---------------------------------------------------------------- the control


def test_w_the_observed_shape_is_coherent() -> None:
    decision = decide(observed_shape())
    assert decision.coherent
    assert decision.to_json_dict() == {"decision": "coherent", "findings": []}


def test_w_co_located_ranks_on_one_selected_host_are_coherent() -> None:
    # Distinct selected hosts is not one-rank-per-host: TP may co-locate ranks.
    obs = observed_shape()
    obs["selected_hosts"] = ["host-a"]
    obs["participants"] = [_participant(0, "host-a", "100"), _participant(1, "host-a", "101")]
    assert decide(obs).coherent


# ---------------------------------------------------------------- rank set


def test_w_a_missing_rank_refuses() -> None:
    obs = observed_shape()
    del obs["participants"][1]
    assert findings(obs) == [
        {"kind": "participant_count_mismatch", "world_size": 2, "participant_count": 1},
        {"kind": "selected_host_carried_no_rank", "host": "host-b"},
    ]


def test_w_a_duplicated_rank_refuses() -> None:
    obs = observed_shape()
    obs["participants"][1] = _participant(0, "host-b", "3764")
    # Count is right and every rank is in range: only the duplicate gives it away.
    assert findings(obs) == [
        {"kind": "duplicated_rank", "global_rank": 0, "occurrences": 2, "hosts": ["host-a", "host-b"]},
    ]


def test_w_a_rank_outside_the_expected_set_refuses() -> None:
    obs = observed_shape()
    obs["participants"].append(_participant(2, "host-b", "3765"))
    assert findings(obs) == [
        {"kind": "participant_count_mismatch", "world_size": 2, "participant_count": 3},
        {"kind": "rank_out_of_range", "global_rank": 2, "host": "host-b", "world_size": 2},
    ]


def test_w_a_negative_rank_is_out_of_range() -> None:
    obs = observed_shape()
    obs["participants"][0] = _participant(-1, "host-a", "46055")
    assert findings(obs) == [
        {"kind": "rank_out_of_range", "global_rank": -1, "host": "host-a", "world_size": 2},
    ]


def test_w_a_right_sized_population_with_wrong_ranks_still_refuses() -> None:
    obs = observed_shape()
    obs["participants"] = [_participant(1, "host-a", "46055"), _participant(2, "host-b", "3764")]
    # Two participants for a world of two, no duplicate; rank 0 is missing and 2 is foreign.
    assert findings(obs) == [
        {"kind": "rank_out_of_range", "global_rank": 2, "host": "host-b", "world_size": 2},
    ]


# ---------------------------------------------------------------- host join


def test_w_a_participant_on_an_unselected_host_refuses() -> None:
    obs = observed_shape()
    obs["world_size"] = obs["tensor_parallel_size"] = 3
    obs["participants"].append(_participant(2, "host-c", "777"))
    assert findings(obs) == [
        {"kind": "participant_on_unselected_host", "global_rank": 2, "host": "host-c"},
    ]


def test_w_a_selected_host_carrying_no_rank_refuses() -> None:
    obs = observed_shape()
    obs["selected_hosts"].append("host-c")
    assert findings(obs) == [{"kind": "selected_host_carried_no_rank", "host": "host-c"}]


def test_w_a_selected_unit_naming_one_host_twice_refuses() -> None:
    obs = observed_shape()
    obs["selected_hosts"] = ["host-a", "host-a"]
    obs["participants"] = [_participant(0, "host-a", "46055"), _participant(1, "host-a", "46056")]
    # Every existence check of the host join passes; only distinctness fails.
    assert findings(obs) == [{"kind": "selected_host_named_more_than_once", "host": "host-a", "occurrences": 2}]


def test_w_two_ranks_on_one_host_of_a_distinct_pair_refuses_only_for_the_idle_host() -> None:
    obs = observed_shape()
    obs["participants"] = [_participant(0, "host-a", "46055"), _participant(1, "host-a", "46056")]
    assert findings(obs) == [{"kind": "selected_host_carried_no_rank", "host": "host-b"}]


# ---------------------------------------------------------------- process keys


def test_w_two_ranks_sharing_one_process_key_on_one_host_refuses() -> None:
    obs = observed_shape()
    obs["selected_hosts"] = ["host-a"]
    obs["participants"] = [_participant(0, "host-a", "46055"), _participant(1, "host-a", "46055")]
    assert findings(obs) == [
        {
            "kind": "ranks_share_host_local_worker_process_key",
            "host": "host-a",
            "process_key": "46055",
            "global_ranks": [0, 1],
        }
    ]


def test_w_one_pid_on_each_of_two_hosts_is_not_a_shared_process_key() -> None:
    obs = observed_shape()
    obs["participants"] = [_participant(0, "host-a", "46055"), _participant(1, "host-b", "46055")]
    assert decide(obs).coherent


# ---------------------------------------------------------------- incarnation, completeness


def test_w_a_participant_from_another_incarnation_refuses() -> None:
    obs = observed_shape()
    obs["participants"][1] = _participant(1, "host-b", "3764", inc="engine-9c01")
    assert findings(obs) == [
        {
            "kind": "participant_from_another_incarnation",
            "global_rank": 1,
            "host": "host-b",
            "participant_incarnation": "engine-9c01",
            "observation_incarnation": INCARNATION,
        }
    ]


def test_w_an_incomplete_observation_refuses_even_with_every_rank_present() -> None:
    obs = observed_shape()
    obs["returned_completely"] = False
    assert findings(obs) == [{"kind": "observation_incomplete", "participant_count": 2}]


# ---------------------------------------------------------------- decomposition


def test_w_a_pipeline_parallel_decomposition_of_the_same_world_size_refuses() -> None:
    obs = observed_shape()
    obs["tensor_parallel_size"], obs["pipeline_parallel_size"] = 1, 2
    # Same world size, same participants: a bare world size cannot tell these apart.
    assert findings(obs) == [
        {
            "kind": "not_a_tensor_parallel_decomposition",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 2,
            "data_parallel_size": 1,
        }
    ]


def test_w_a_data_parallel_decomposition_refuses() -> None:
    obs = observed_shape()
    obs["tensor_parallel_size"], obs["data_parallel_size"] = 1, 2
    assert [f["kind"] for f in findings(obs)] == ["not_a_tensor_parallel_decomposition"]


def test_w_a_decomposition_inconsistent_with_its_world_size_refuses() -> None:
    obs = observed_shape()
    obs["tensor_parallel_size"] = 4
    assert findings(obs) == [
        {
            "kind": "decomposition_inconsistent_with_world_size",
            "world_size": 2,
            "tensor_parallel_size": 4,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "product": 4,
        }
    ]


def test_w_a_tensor_parallel_rank_that_contradicts_its_global_rank_refuses() -> None:
    obs = observed_shape()
    obs["participants"][1] = _participant(1, "host-b", "3764", tp=0)
    assert findings(obs) == [
        {"kind": "tensor_parallel_rank_does_not_match_global_rank", "global_rank": 1, "tensor_parallel_rank": 0,
         "host": "host-b"}
    ]


def test_w_an_out_of_range_tensor_parallel_rank_refuses_through_correspondence() -> None:
    obs = observed_shape()
    obs["participants"][0] = _participant(0, "host-a", "46055", tp=7)
    assert findings(obs) == [
        {"kind": "tensor_parallel_rank_does_not_match_global_rank", "global_rank": 0, "tensor_parallel_rank": 7,
         "host": "host-a"}
    ]


# ---------------------------------------------------------------- every finding


def test_w_a_population_wrong_in_several_ways_reports_all_of_them() -> None:
    obs = observed_shape()
    obs["returned_completely"] = False
    obs["pipeline_parallel_size"] = 2  # 2 * 2 * 1 != 2 and not pure TP
    obs["selected_hosts"] = ["host-a", "host-a", "host-b"]
    obs["participants"] = [
        _participant(0, "host-a", "46055"),
        _participant(0, "host-c", "46055", tp=1, inc="engine-0000"),
        _participant(5, "host-a", "46055"),
    ]
    got = findings(obs)
    assert got == [
        {"kind": "participant_count_mismatch", "world_size": 2, "participant_count": 3},
        {"kind": "duplicated_rank", "global_rank": 0, "occurrences": 2, "hosts": ["host-a", "host-c"]},
        {"kind": "rank_out_of_range", "global_rank": 5, "host": "host-a", "world_size": 2},
        {"kind": "participant_on_unselected_host", "global_rank": 0, "host": "host-c"},
        {"kind": "selected_host_carried_no_rank", "host": "host-b"},
        {"kind": "selected_host_named_more_than_once", "host": "host-a", "occurrences": 2},
        {"kind": "ranks_share_host_local_worker_process_key", "host": "host-a", "process_key": "46055",
         "global_ranks": [0, 5]},
        {"kind": "participant_from_another_incarnation", "global_rank": 0, "host": "host-c",
         "participant_incarnation": "engine-0000", "observation_incarnation": INCARNATION},
        {"kind": "observation_incomplete", "participant_count": 3},
        {"kind": "not_a_tensor_parallel_decomposition", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
         "data_parallel_size": 1},
        {"kind": "decomposition_inconsistent_with_world_size", "world_size": 2, "tensor_parallel_size": 2,
         "pipeline_parallel_size": 2, "data_parallel_size": 1, "product": 4},
    ]
    # This one population trips every kind the law has, each exactly once, but TP-rank correspondence:
    # host-c's TP rank 1 against global rank 0 is no finding in a PP = 2 world (see the next witness),
    # so no population can carry both that and not_a_tensor_parallel_decomposition.
    assert [f["kind"] for f in got] == [k for k in FINDING_KINDS if k != "tensor_parallel_rank_does_not_match_global_rank"]
    obs["pipeline_parallel_size"] = 1  # now pure TP (of the wrong size): correspondence applies again
    assert "tensor_parallel_rank_does_not_match_global_rank" in [f["kind"] for f in findings(obs)]


@pytest.mark.parametrize("sizes", [(1, 2, 1), (1, 1, 2)], ids=["pp2-tp1", "dp2-tp1"])
def test_w_a_world_that_is_not_pure_tp_is_not_also_refused_rank_by_rank_for_tp_correspondence(
    sizes: tuple[int, int, int],
) -> None:
    # vLLM gives each rank of a PP = 2 / TP = 1 world TP rank 0. TP rank = global rank is the law of
    # a pure TP world; here its premise is false and not_a_tensor_parallel_decomposition already says so.
    obs = observed_shape()
    obs["tensor_parallel_size"], obs["pipeline_parallel_size"], obs["data_parallel_size"] = sizes
    obs["participants"] = [_participant(0, "host-a", "46055", tp=0), _participant(1, "host-b", "3764", tp=0)]
    assert findings(obs) == [
        {"kind": "not_a_tensor_parallel_decomposition", "tensor_parallel_size": 1,
         "pipeline_parallel_size": sizes[1], "data_parallel_size": sizes[2]},
    ]


def test_findings_do_not_depend_on_participant_or_host_order() -> None:
    obs = observed_shape()
    obs["returned_completely"] = False
    obs["selected_hosts"] = ["host-b", "host-c", "host-a"]
    obs["participants"] = [_participant(3, "host-d", "9"), _participant(0, "host-a", "9", tp=2)]
    reordered = copy.deepcopy(obs)
    reordered["selected_hosts"].reverse()
    reordered["participants"].reverse()
    assert decide(obs) == decide(reordered)


@pytest.mark.parametrize(
    ("decision", "findings_"),
    [("coherent", [{"kind": "observation_incomplete", "participant_count": 0}]), ("refused", [])],
)
def test_a_decision_cannot_contradict_its_findings(decision: str, findings_: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="coherent decision carries no findings"):
        RankPopulationDecision.model_validate({"decision": decision, "findings": findings_})
