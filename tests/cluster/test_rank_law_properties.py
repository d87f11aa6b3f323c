"""Property tests: the law is coherent exactly when the population is.

The reference predicate below is written independently of the law, in the
plainest terms (it enumerates the expected ranks, which the law never does).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.system.ranks import FINDING_KINDS, DeclaredObservation, Participant, decide_rank_population

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HOSTS = ["host-a", "host-b", "host-c", "host-d"]
KEYS = ["1", "2", "3"]


def reference_is_coherent(obs: DeclaredObservation) -> bool:
    """Complete, duplicate-free, pure-TP, one incarnation, distinct selected hosts each carrying a rank,
    process keys unique within each host."""
    parts = obs.participants
    complete_and_unique = sorted(p.global_rank for p in parts) == list(range(obs.world_size))
    pure_tp = (
        obs.pipeline_parallel_size == 1
        and obs.data_parallel_size == 1
        and obs.tensor_parallel_size == obs.world_size
        and all(p.tensor_parallel_rank == p.global_rank for p in parts)
    )
    current = all(p.incarnation == obs.incarnation for p in parts)
    hosts_distinct = len(set(obs.selected_hosts)) == len(obs.selected_hosts)
    hosts_joined = {p.host for p in parts} == set(obs.selected_hosts)
    keys_unique = len({(p.host, p.host_local_worker_process_key) for p in parts}) == len(parts)
    return (
        obs.returned_completely
        and complete_and_unique
        and pure_tp
        and current
        and hosts_distinct
        and hosts_joined
        and keys_unique
    )


@st.composite
def coherent_observations(draw: st.DrawFn) -> DeclaredObservation:
    world = draw(st.integers(1, 8))
    n_hosts = draw(st.integers(1, min(world, len(HOSTS))))
    hosts = draw(st.permutations(HOSTS))[:n_hosts]
    # Every host carries at least one rank; the rest land anywhere.
    placement = hosts + [draw(st.sampled_from(hosts)) for _ in range(world - n_hosts)]
    placement = draw(st.permutations(placement))
    incarnation = draw(st.text("abcdef0123456789", min_size=1, max_size=8))
    # Keys are per-host counters, so the same key on two hosts is common (and legal).
    seen: Counter[str] = Counter()
    participants = []
    for rank, host in enumerate(placement):
        seen[host] += 1
        participants.append(
            Participant(
                global_rank=rank,
                tensor_parallel_rank=rank,
                host=host,
                host_local_worker_process_key=str(seen[host]),
                incarnation=incarnation,
            )
        )
    return DeclaredObservation(
        incarnation=incarnation,
        returned_completely=True,
        world_size=world,
        tensor_parallel_size=world,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        selected_hosts=tuple(draw(st.permutations(hosts))),
        participants=tuple(draw(st.permutations(participants))),
    )


@st.composite
def arbitrary_observations(draw: st.DrawFn) -> DeclaredObservation:
    """Small domains so that collisions, gaps and mismatches are frequent."""
    world = draw(st.integers(1, 4))
    participant = st.builds(
        Participant,
        global_rank=st.integers(-1, 4),
        tensor_parallel_rank=st.integers(-1, 4),
        host=st.sampled_from(HOSTS[:3]),
        host_local_worker_process_key=st.sampled_from(KEYS),
        incarnation=st.sampled_from(["i0", "i1"]),
    )
    return DeclaredObservation(
        incarnation="i0",
        returned_completely=draw(st.booleans()),
        world_size=world,
        tensor_parallel_size=draw(st.sampled_from([world, 1, 2, 4])),
        pipeline_parallel_size=draw(st.sampled_from([1, 1, 1, 2])),
        data_parallel_size=draw(st.sampled_from([1, 1, 1, 2])),
        selected_hosts=tuple(draw(st.lists(st.sampled_from(HOSTS[:3]), max_size=4))),
        participants=tuple(draw(st.lists(participant, max_size=5))),
    )


def _with(obs: DeclaredObservation, **changes: Any) -> DeclaredObservation:
    return obs.model_copy(update=changes)


def _with_participant(obs: DeclaredObservation, index: int, **changes: Any) -> DeclaredObservation:
    parts = list(obs.participants)
    parts[index] = parts[index].model_copy(update=changes)
    return _with(obs, participants=tuple(parts))


# One mutation per finding kind; each takes a coherent observation and an index.
Mutation = Callable[[DeclaredObservation, int], DeclaredObservation]
MUTATIONS: dict[str, Mutation] = {
    "participant_count_mismatch": lambda o, i: _with(o, world_size=o.world_size + 1, tensor_parallel_size=o.world_size + 1),
    "duplicated_rank": lambda o, i: _with(o, participants=o.participants + (o.participants[i].model_copy(
        update={"host_local_worker_process_key": "dup"}),), returned_completely=True),
    "rank_out_of_range": lambda o, i: _with_participant(
        o, i, global_rank=o.world_size + i, tensor_parallel_rank=o.world_size + i),
    "participant_on_unselected_host": lambda o, i: _with_participant(o, i, host="host-unselected"),
    "selected_host_carried_no_rank": lambda o, i: _with(o, selected_hosts=o.selected_hosts + ("host-idle",)),
    "selected_host_named_more_than_once": lambda o, i: _with(
        o, selected_hosts=o.selected_hosts + (o.selected_hosts[i % len(o.selected_hosts)],)),
    "ranks_share_host_local_worker_process_key": lambda o, i: _with(o, participants=o.participants + (
        Participant(global_rank=o.world_size, tensor_parallel_rank=o.world_size, host=o.participants[i].host,
                    host_local_worker_process_key=o.participants[i].host_local_worker_process_key,
                    incarnation=o.incarnation),)),
    "participant_from_another_incarnation": lambda o, i: _with_participant(o, i, incarnation=o.incarnation + "-old"),
    "observation_incomplete": lambda o, i: _with(o, returned_completely=False),
    "not_a_tensor_parallel_decomposition": lambda o, i: _with(o, pipeline_parallel_size=2),
    "decomposition_inconsistent_with_world_size": lambda o, i: _with(o, tensor_parallel_size=o.world_size + 1),
    "tensor_parallel_rank_does_not_match_global_rank": lambda o, i: _with_participant(
        o, i, tensor_parallel_rank=o.participants[i].global_rank + 1),
}


def test_there_is_one_mutation_per_finding_kind() -> None:
    assert set(MUTATIONS) == set(FINDING_KINDS)


@PROPERTY_SETTINGS
@given(coherent_observations(), st.sampled_from(sorted(MUTATIONS)), st.integers(0, 7))
def test_each_mutation_refuses_with_its_own_kind(obs: DeclaredObservation, kind: str, index: int) -> None:
    mutated = MUTATIONS[kind](obs, index % len(obs.participants))
    decision = decide_rank_population(mutated)
    assert not reference_is_coherent(mutated)
    assert decision.decision == "refused"
    assert kind in decision.kinds


def reference_violations(obs: DeclaredObservation) -> set[str]:
    """Each finding kind whose condition the observation violates, stated one by one."""
    parts = obs.participants
    ranks = [p.global_rank for p in parts]
    host_keys = [(p.host, p.host_local_worker_process_key) for p in parts]
    tp, pp, dp = obs.tensor_parallel_size, obs.pipeline_parallel_size, obs.data_parallel_size
    conditions = {
        "participant_count_mismatch": len(parts) != obs.world_size,
        "duplicated_rank": len(set(ranks)) != len(ranks),
        "rank_out_of_range": not set(ranks) <= set(range(obs.world_size)),
        "participant_on_unselected_host": not {p.host for p in parts} <= set(obs.selected_hosts),
        "selected_host_carried_no_rank": not set(obs.selected_hosts) <= {p.host for p in parts},
        "selected_host_named_more_than_once": len(set(obs.selected_hosts)) != len(obs.selected_hosts),
        "ranks_share_host_local_worker_process_key": len(set(host_keys)) != len(host_keys),
        "participant_from_another_incarnation": {p.incarnation for p in parts} - {obs.incarnation} != set(),
        "observation_incomplete": not obs.returned_completely,
        "not_a_tensor_parallel_decomposition": (pp, dp) != (1, 1),
        "decomposition_inconsistent_with_world_size": tp * pp * dp != obs.world_size,
        # Correspondence is the law of a pure TP world; elsewhere the decomposition finding already holds.
        "tensor_parallel_rank_does_not_match_global_rank": (pp, dp) == (1, 1)
        and any(p.tensor_parallel_rank != p.global_rank for p in parts),
    }
    return {kind for kind, violated in conditions.items() if violated}


@st.composite
def mutated_observations(draw: st.DrawFn) -> DeclaredObservation:
    """A coherent observation with one to three mutations applied in sequence."""
    obs = draw(coherent_observations())
    for kind in draw(st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3)):
        obs = MUTATIONS[kind](obs, draw(st.integers(0, len(obs.participants) - 1)))
    return obs


@PROPERTY_SETTINGS
@given(coherent_observations())
def test_every_coherent_population_is_decided_coherent(obs: DeclaredObservation) -> None:
    assert reference_is_coherent(obs)
    decision = decide_rank_population(obs)
    assert decision.coherent and decision.findings == ()


@PROPERTY_SETTINGS
@given(st.one_of(coherent_observations(), mutated_observations(), arbitrary_observations()))
def test_coherent_exactly_when_the_reference_says_so(obs: DeclaredObservation) -> None:
    decision = decide_rank_population(obs)
    assert decision.coherent == reference_is_coherent(obs)
    assert decision.coherent == (decision.findings == ())


@PROPERTY_SETTINGS
@given(st.one_of(coherent_observations(), mutated_observations(), arbitrary_observations()))
def test_every_violated_condition_is_reported_and_no_other(obs: DeclaredObservation) -> None:
    assert set(decide_rank_population(obs).kinds) == reference_violations(obs)


@PROPERTY_SETTINGS
@given(st.one_of(coherent_observations(), arbitrary_observations()), st.randoms(use_true_random=False))
def test_the_decision_ignores_list_order(obs: DeclaredObservation, rnd: Any) -> None:
    parts, hosts = list(obs.participants), list(obs.selected_hosts)
    rnd.shuffle(parts)
    rnd.shuffle(hosts)
    shuffled = _with(obs, participants=tuple(parts), selected_hosts=tuple(hosts))
    assert decide_rank_population(shuffled) == decide_rank_population(obs)


@PROPERTY_SETTINGS
@given(arbitrary_observations())
def test_findings_come_in_the_declared_kind_order(obs: DeclaredObservation) -> None:
    order = [FINDING_KINDS.index(k) for k in decide_rank_population(obs).kinds]
    assert order == sorted(order)
