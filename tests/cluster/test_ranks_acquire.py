"""The torch.distributed acquisition adapter, against real gloo worlds.

* two processes on this machine form a world and yield a coherent receipt;
* a real world checked against a host that carried nothing is refused and
  yields no receipt;
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
from pydantic import ValidationError
from typer.testing import CliRunner

from kiln.canonical import strict_json_loads
from kiln.cluster.acquire import (
    AcquisitionOutcome,
    AcquisitionRecord,
    NotCoherentError,
    RankPopulationReceipt,
    WorldPlan,
    acquire_rank_population,
)
from kiln.cluster.cli import app
from kiln.cluster.ranks import DeclaredObservation, Participant, decide_rank_population

CLI = [sys.executable, "-m", "kiln.cluster.cli"]
WORLD_TIMEOUT_S = 60


def _assert_receipt_of_a_real_world(result: dict[str, Any], *, hosts: list[str], master_addr: str) -> None:
    receipt = RankPopulationReceipt.from_json_dict(result)
    acq, obs = receipt.acquisition, receipt.observation
    assert receipt.decision.coherent
    assert acq.method == "multiprocessing.spawn+gloo" and acq.backend == "gloo"
    assert acq.torch_version == version("torch")
    assert acq.master_addr == master_addr and 0 < acq.master_port < 65536
    started, finished = datetime.fromisoformat(acq.started_at), datetime.fromisoformat(acq.finished_at)
    assert started < finished and started.utcoffset() is not None
    assert acq.world_size == obs.world_size == len(hosts)
    assert acq.tensor_parallel_group_ranks == tuple(range(len(hosts)))
    assert (obs.tensor_parallel_size, obs.pipeline_parallel_size, obs.data_parallel_size) == (len(hosts), 1, 1)
    assert re.fullmatch(r"[0-9a-f]{32}", obs.incarnation)
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
    with pytest.raises(ValidationError, match="a receipt needs a coherent decision"):
        RankPopulationReceipt.from_json_dict(outcome.to_json_dict())
    # The refused outcome still round-trips as an outcome, record beside decision.
    assert AcquisitionOutcome.from_json_dict(outcome.to_json_dict()) == outcome


def test_a_world_whose_other_host_never_arrives_fails_clearly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(
        app,
        ["observe", "--nproc-per-host", "1", "--nnodes", "2", "--master-port", str(port),
         "--selected-host", "a", "--selected-host", "b", "--timeout-s", "1"],
    )
    assert result.exit_code == 3, result.output
    assert f"the gloo world at 127.0.0.1:{port} did not complete (node 0 of 2)" in result.stderr
    assert "DistStoreError" in result.stderr and "1/2 clients joined" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# --------------------------------------------------------------- receipts are joins


def _record(world_size: int) -> AcquisitionRecord:
    return AcquisitionRecord(
        method="multiprocessing.spawn+gloo", backend="gloo", torch_version="2.13.0",
        started_at="2026-01-01T00:00:00.000+00:00", finished_at="2026-01-01T00:00:01.000+00:00",
        master_addr="127.0.0.1", master_port=29500, world_size=world_size, nnodes=1, nproc_per_host=world_size,
        collector_host="h", collector_pid=1, rank0_pid=10, tensor_parallel_group_ranks=tuple(range(world_size)),
    )


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


def test_a_receipt_cannot_carry_a_decision_the_law_did_not_make() -> None:
    coherent = decide_rank_population(_observation())
    incomplete = _observation(complete=False)
    with pytest.raises(ValidationError, match="not the law's decision"):
        RankPopulationReceipt(acquisition=_record(2), observation=incomplete, decision=coherent)
    with pytest.raises(ValidationError, match="disagree on the world size"):
        RankPopulationReceipt(acquisition=_record(3), observation=_observation(), decision=coherent)
    ok = RankPopulationReceipt(acquisition=_record(2), observation=_observation(), decision=coherent)
    assert RankPopulationReceipt.from_json_dict(ok.to_json_dict()) == ok


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
                        "--master-addr", master, "--master-port", "29500", "--timeout-s", "30"]
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
    _assert_receipt_of_a_real_world(result, hosts=names, master_addr=master)
    assert result["acquisition"]["collector_host"] == "kiln-ns-host-a"
    assert result["acquisition"]["nnodes"] == 2
