"""The torch.distributed acquisition adapter, against real gloo worlds.

* two processes on this machine form a world and yield a coherent receipt;
* a real world checked against a host that carried nothing is refused and
  yields no receipt;
* four processes whose caller makes PP = 2 x TP = 2 groups are acquired as
  they are, and the same TP pairs labelled pure TP are refused by the law;
* a rank that belongs to another incarnation is caught in a real world;
* receipts are minted only by acquisition; documents are evidence, re-checked;
* a world whose second host never arrives fails with a clear message;
* two "hosts" built from Linux network + UTS namespaces joined by a veth pair
  form one world over 10.x addresses that exist only inside those namespaces.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from kiln.canonical import strict_json_loads
from kiln.cluster.acquire import (
    AcquisitionEvidence,
    AcquisitionOutcome,
    AcquisitionRecord,
    AcquisitionRecordError,
    EvidenceError,
    GridLayout,
    NotCoherentError,
    RankPopulationReceipt,
    ReceiptForgeryError,
    WorldPlan,
    acquire_rank_population,
)
from kiln.cluster.cli import app
from kiln.system.ranks import DeclaredObservation, Participant, decide_rank_population
from tests.cluster import layouts

CLI = [sys.executable, "-m", "kiln.cluster.cli"]
WORLD_TIMEOUT_S = 60


def _assert_receipt_of_a_real_world(
    result: dict[str, Any], *, hosts: list[str], master_addr: str, incarnation: str | None = None
) -> None:
    evidence = AcquisitionEvidence.from_json_dict(result)
    acq, obs = evidence.acquisition, evidence.observation
    assert evidence.coherent
    assert acq.method == "multiprocessing.spawn+gloo" and acq.backend == "gloo"
    assert acq.torch_version == version("torch")
    assert acq.master_addr == master_addr and 0 < acq.master_port < 65536
    started, finished = datetime.fromisoformat(acq.started_at), datetime.fromisoformat(acq.finished_at)
    assert started < finished and started.utcoffset() is not None
    assert acq.world_size == obs.world_size == len(hosts)
    assert acq.tensor_parallel_groups == (tuple(range(len(hosts))),)
    assert acq.pipeline_parallel_groups == tuple((r,) for r in range(len(hosts)))
    assert acq.data_parallel_groups is None
    assert (obs.tensor_parallel_size, obs.pipeline_parallel_size, obs.data_parallel_size) == (len(hosts), 1, 1)
    if incarnation is None:  # drawn by the single-host supervisor
        assert re.fullmatch(r"[0-9a-f]{32}", obs.incarnation)
    else:
        assert obs.incarnation == incarnation
    by_rank = sorted(obs.participants, key=lambda p: p.global_rank)
    assert [p.host for p in by_rank] == hosts
    assert [p.tensor_parallel_rank for p in by_rank] == list(range(len(hosts)))
    assert all(p.incarnation == obs.incarnation for p in by_rank)
    pids = [int(p.host_local_worker_process_key) for p in by_rank]
    assert len(set(pids)) == len(pids) and acq.collector_pid not in pids and os.getpid() not in pids
    assert acq.rank0_pid == pids[0]


# --------------------------------------------------------------- one machine


def test_two_processes_on_one_machine_produce_a_coherent_receipt(tmp_path: Path) -> None:
    out = tmp_path / "receipt.json"
    proc = subprocess.run(
        [*CLI, "observe", "--nproc-per-host", "2", "--timeout-s", "30", "--out", str(out)],
        capture_output=True,
        timeout=WORLD_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(proc.stdout)
    assert strict_json_loads(out.read_bytes()) == result
    host = socket.gethostname()
    _assert_receipt_of_a_real_world(result, hosts=[host, host], master_addr="127.0.0.1")
    assert result["acquisition"]["collector_host"] == host


def test_a_real_world_refused_by_the_law_mints_no_receipt() -> None:
    host = socket.gethostname()
    outcome = acquire_rank_population(
        WorldPlan(nproc_per_host=1, selected_hosts=(host, "kiln-test-idle-host"), timeout_s=30)
    )
    assert outcome is not None
    assert outcome.decision.to_json_dict()["findings"] == [
        {"kind": "selected_host_carried_no_rank", "host": "kiln-test-idle-host"}
    ]
    with pytest.raises(NotCoherentError, match="selected_host_carried_no_rank"):
        outcome.receipt()
    # Read back, the refused outcome is evidence of a refusal, and nothing more.
    evidence = AcquisitionEvidence.from_json_dict(outcome.to_json_dict())
    assert not evidence.coherent
    assert (evidence.acquisition, evidence.observation, evidence.decision) == (
        outcome.acquisition, outcome.observation, outcome.decision
    )
    with pytest.raises(ReceiptForgeryError):
        RankPopulationReceipt.from_json_dict(outcome.to_json_dict())
    with pytest.raises(ReceiptForgeryError):
        AcquisitionOutcome.from_json_dict(outcome.to_json_dict())


# --------------------------------------------------------------- observed layouts (issue 16)


def test_a_pipeline_2_by_tensor_2_world_is_acquired_as_the_caller_laid_it_out() -> None:
    outcome = acquire_rank_population(WorldPlan(nproc_per_host=4, timeout_s=30), layouts.pipeline_2_by_tensor_2)
    assert outcome is not None
    acq, obs = outcome.acquisition, outcome.observation
    assert acq.tensor_parallel_groups == ((0, 1), (2, 3))
    assert acq.pipeline_parallel_groups == ((0, 2), (1, 3))
    assert (obs.world_size, obs.tensor_parallel_size, obs.pipeline_parallel_size, obs.data_parallel_size) == (
        4, 2, 2, 1
    )
    by_rank = sorted(obs.participants, key=lambda p: p.global_rank)
    assert [p.tensor_parallel_rank for p in by_rank] == [0, 1, 0, 1]  # what each rank saw, not its global rank
    assert len({p.host_local_worker_process_key for p in by_rank}) == 4
    # Every check of the law passes but its scope: the one finding is that PP = 2 is not pure TP
    # (and, per issue 17, no TP-rank "mismatch" per rank restating it).
    assert outcome.decision.to_json_dict()["findings"] == [
        {"kind": "not_a_tensor_parallel_decomposition", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
         "data_parallel_size": 1},
    ]
    with pytest.raises(NotCoherentError):
        outcome.receipt()
    assert AcquisitionEvidence.from_json_dict(outcome.to_json_dict()).decision == outcome.decision


def test_the_same_tensor_pairs_labelled_pure_tensor_parallel_are_refused_by_the_law() -> None:
    outcome = acquire_rank_population(
        WorldPlan(nproc_per_host=4, timeout_s=30), layouts.tensor_2_with_its_stages_left_unlabelled
    )
    assert outcome is not None
    host = socket.gethostname()
    assert outcome.decision.to_json_dict()["findings"] == [
        {"kind": "decomposition_inconsistent_with_world_size", "world_size": 4, "tensor_parallel_size": 2,
         "pipeline_parallel_size": 1, "data_parallel_size": 1, "product": 2},
        {"kind": "tensor_parallel_rank_does_not_match_global_rank", "global_rank": 2, "tensor_parallel_rank": 0,
         "host": host},
        {"kind": "tensor_parallel_rank_does_not_match_global_rank", "global_rank": 3, "tensor_parallel_rank": 1,
         "host": host},
    ]


def test_a_rank_of_another_incarnation_is_caught_in_a_real_world() -> None:
    outcome = acquire_rank_population(
        WorldPlan(nproc_per_host=2, incarnation="engine-now", timeout_s=30), layouts.rank_1_belongs_to_another_engine
    )
    assert outcome is not None
    assert outcome.decision.to_json_dict()["findings"] == [
        {"kind": "participant_from_another_incarnation", "global_rank": 1, "host": socket.gethostname(),
         "participant_incarnation": layouts.ANOTHER_ENGINE, "observation_incarnation": "engine-now"},
    ]


def test_observe_builds_pipeline_stages_from_the_command_line() -> None:
    # PP = 2 / TP = 1 acquired for real: the scope finding alone (issue 17), exit 1.
    result = CliRunner().invoke(
        app, ["observe", "--nproc-per-host", "2", "--pipeline-parallel-size", "2", "--timeout-s", "30"]
    )
    assert result.exit_code == 1, result.output
    out = json.loads(result.stdout)
    assert out["acquisition"]["tensor_parallel_groups"] == [[0], [1]]
    assert out["acquisition"]["pipeline_parallel_groups"] == [[0, 1]]
    assert out["findings"] == [
        {"kind": "not_a_tensor_parallel_decomposition", "tensor_parallel_size": 1, "pipeline_parallel_size": 2,
         "data_parallel_size": 1},
    ]


def test_a_world_whose_other_host_never_arrives_fails_clearly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(
        app,
        ["observe", "--nproc-per-host", "1", "--nnodes", "2", "--master-port", str(port),
         "--selected-host", "a", "--selected-host", "b", "--incarnation", "run-1", "--timeout-s", "1"],
    )
    assert result.exit_code == 3, result.output
    assert f"the gloo world at 127.0.0.1:{port} did not complete (node 0 of 2)" in result.stderr
    assert "DistStoreError" in result.stderr and "1/2 clients joined" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# --------------------------------------------------------------- receipts are minted (issue 15)


def _record(**changes: Any) -> dict[str, Any]:
    """A record as JSON, consistent with :func:`_observation` unless changed."""
    return {
        "method": "multiprocessing.spawn+gloo", "backend": "gloo", "torch_version": "2.13.0",
        "started_at": "2026-01-01T00:00:00.000+00:00", "finished_at": "2026-01-01T00:00:01.000+00:00",
        "master_addr": "127.0.0.1", "master_port": 29500, "world_size": 2, "nnodes": 1, "nproc_per_host": 2,
        "collector_host": "h", "collector_pid": 1, "rank0_pid": 10,
        "tensor_parallel_groups": [[0, 1]], "pipeline_parallel_groups": [[0], [1]], "data_parallel_groups": None,
        **changes,
    }


def _observation(*, complete: bool = True) -> DeclaredObservation:
    parts = tuple(
        Participant(global_rank=r, tensor_parallel_rank=r, host="h", host_local_worker_process_key=str(10 + r),
                    incarnation="i")
        for r in range(2)
    )
    return DeclaredObservation(
        incarnation="i", returned_completely=complete, world_size=2, tensor_parallel_size=2,
        pipeline_parallel_size=1, data_parallel_size=1, selected_hosts=("h",), participants=parts,
    )


def _document(record: dict[str, Any], obs: DeclaredObservation | None = None) -> dict[str, Any]:
    obs = obs or _observation()
    return {**decide_rank_population(obs).to_json_dict(), "acquisition": record,
            "observation": obs.model_dump(mode="json")}


FORGED_RECORDS: dict[str, tuple[dict[str, Any], str]] = {
    "negative port": (_record(master_port=-5), "master_port"),
    "99 nodes for a world of 2": (_record(nnodes=99), "nnodes=99 x nproc_per_host=2 is not world_size=2"),
    "no process per host": (_record(nproc_per_host=0), "nproc_per_host"),
    "an empty TP group": (_record(tensor_parallel_groups=[[]]), "tensor_parallel_groups contain an empty group"),
    "no TP group at all": (_record(tensor_parallel_groups=[]), "tensor_parallel_groups"),
    "overlapping TP groups": (_record(tensor_parallel_groups=[[0], [0]]), "overlap: a rank is in two groups"),
    "TP groups missing a rank": (_record(tensor_parallel_groups=[[0]], pipeline_parallel_groups=[[0, 1]]),
                                 "tensor_parallel_groups do not cover exactly the ranks 0..1"),
    "TP and PP groups that coincide": (_record(pipeline_parallel_groups=[[0, 1]]), "shares more than one rank"),
    "finished before it started": (_record(finished_at="2025-01-01T00:00:00+00:00"), "finished_at is before"),
    "a port given as text": (_record(master_port="29500"), "master_port"),
}


@pytest.mark.parametrize("name", sorted(FORGED_RECORDS))
def test_an_invented_acquisition_record_is_refused_everywhere(name: str) -> None:
    record, fragment = FORGED_RECORDS[name]
    with pytest.raises(AcquisitionRecordError, match=re.escape(fragment)):
        AcquisitionRecord.from_json_value(record)
    with pytest.raises(AcquisitionRecordError, match=re.escape(fragment)):
        AcquisitionEvidence.from_json_dict(_document(record))
    with pytest.raises(ReceiptForgeryError, match="never deserialised"):
        RankPopulationReceipt.from_json_dict(_document(record))
    if name != "a port given as text":  # the constructor takes Python values; the rest are the same forgeries
        with pytest.raises(AcquisitionRecordError, match=re.escape(fragment)):
            AcquisitionRecord(**{k: tuple(map(tuple, v)) if k.endswith("_groups") and v is not None else v
                                 for k, v in record.items()})


def test_a_receipt_cannot_be_constructed_even_from_a_consistent_record() -> None:
    record = AcquisitionRecord.from_json_value(_record())  # consistent in itself and with the observation
    obs = _observation()  # written by hand
    decision = decide_rank_population(obs)
    for cls in (RankPopulationReceipt, AcquisitionOutcome):
        with pytest.raises(ReceiptForgeryError, match="minted only by kiln.cluster.acquire.acquire_rank_population"):
            cls(record, obs, decision)
        with pytest.raises(ReceiptForgeryError):
            cls(acquisition=record, observation=obs, decision=decision)
    # The same document is evidence: consistent, coherent, and still no receipt.
    evidence = AcquisitionEvidence.from_json_dict(_document(_record()))
    assert evidence.coherent and not hasattr(evidence, "receipt")


def test_evidence_whose_record_and_observation_disagree_is_refused() -> None:
    cases = {
        "world size": (_record(world_size=4, nproc_per_host=4, tensor_parallel_groups=[[0, 1], [2, 3]],
                               pipeline_parallel_groups=[[0, 2], [1, 3]]), "world size 4"),
        "TP size": (_record(tensor_parallel_groups=[[0], [1]], pipeline_parallel_groups=[[0, 1]]),
                    "tensor_parallel_size=2"),
        "rank 0's process": (_record(rank0_pid=77), "rank 0 is not the recorded rank0_pid"),
        "collector as a rank": (_record(collector_pid=11), "the collector, which runs no rank"),
    }
    for record, fragment in cases.values():
        with pytest.raises(EvidenceError, match=re.escape(fragment)):
            AcquisitionEvidence.from_json_dict(_document(record))


def test_evidence_whose_decision_is_not_the_laws_is_refused() -> None:
    document = _document(_record(), _observation(complete=False))
    document.update(decision="coherent", findings=[])
    with pytest.raises(EvidenceError, match="not the law's decision"):
        AcquisitionEvidence.from_json_dict(document)
    with pytest.raises(EvidenceError, match="exactly the fields"):
        AcquisitionEvidence.from_json_dict({**document, "provenance": "acquired"})


def test_grid_layout_cuts_the_world_as_vllm_does() -> None:
    assert GridLayout(2, 2).groups_for(8) == (
        [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]]
    )
    assert GridLayout(4).groups_for(4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])


# --------------------------------------------------------------- two hosts from namespaces


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return f"network namespaces need root; running as uid {os.geteuid()}"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"kilnprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"], capture_output=True,
                             text=True)
        if uts.returncode != 0:
            return f"`unshare --uts` inside a network namespace failed: {uts.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def _two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair; yields (netns, interface, address) per host."""
    tag = os.getpid() % 100000
    subnet = f"10.{200 + tag % 50}.{tag % 250}"
    hosts = [(f"kiln{tag}a", f"kv{tag}a", f"{subnet}.1"), (f"kiln{tag}b", f"kv{tag}b", f"{subnet}.2")]
    created: list[str] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for ns, _, _ in hosts:
            ip("netns", "add", ns)
            created.append(ns)
        ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, ifname, addr in hosts:
            ip("link", "set", ifname, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in created:  # deleting a namespace also deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", hosts[0][1]], capture_output=True)  # if never moved


def test_two_hosts_from_network_namespaces_produce_a_coherent_receipt() -> None:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    names = ["kiln-ns-host-a", "kiln-ns-host-b"]
    procs: list[subprocess.Popen[bytes]] = []
    with _two_hosts() as hosts:
        master = hosts[0][2]
        try:
            for node_rank, ((ns, ifname, _), name) in enumerate(zip(hosts, names)):
                args = [*CLI, "observe", "--nproc-per-host", "1", "--nnodes", "2", "--node-rank", str(node_rank),
                        "--master-addr", master, "--master-port", "29500", "--incarnation", "ns-run",
                        "--timeout-s", "30"]
                if node_rank == 0:
                    args += [arg for host in names for arg in ("--selected-host", host)]
                # Each host gets its own network stack (netns) and its own host name (UTS namespace).
                cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                       name, *args]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              env={**os.environ, "GLOO_SOCKET_IFNAME": ifname},
                                              start_new_session=True))
            outputs = [p.communicate(timeout=WORLD_TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    (out0, err0), (out1, err1) = outputs
    assert procs[0].returncode == 0, err0.decode()
    assert procs[1].returncode == 0, err1.decode()
    assert json.loads(out1) == {"node_rank": 1, "reported_to": f"{master}:29500"}
    result = json.loads(out0)
    _assert_receipt_of_a_real_world(result, hosts=names, master_addr=master, incarnation="ns-run")
    assert result["acquisition"]["collector_host"] == "kiln-ns-host-a"
    assert result["acquisition"]["nnodes"] == 2
