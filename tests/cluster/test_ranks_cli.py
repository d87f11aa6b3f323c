"""`kiln ranks check`: exit codes, stdout JSON and input validation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.cluster.cli import app
from kiln.system.ranks import FINDING_KINDS, MAX_OBSERVATION_BYTES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text(encoding="utf-8")
# The input example documented in docs/cluster.md (the one issue 6 gives).
EXAMPLE: dict[str, Any] = json.loads(re.findall(r"```json\n(.*?)```", DOC, flags=re.S)[0])


def _run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "kiln.cluster.cli", *args], input=stdin, capture_output=True, timeout=60
    )


def _write(tmp_path: Path, value: Any) -> Path:
    path = tmp_path / "observation.json"
    path.write_text(json.dumps(value) if not isinstance(value, str) else value, encoding="utf-8")
    return path


def test_the_documented_example_is_coherent_and_exits_0(tmp_path: Path) -> None:
    assert EXAMPLE["selected_hosts"] == ["host-a", "host-b"] and len(EXAMPLE["participants"]) == 2
    proc = _run("check", str(_write(tmp_path, EXAMPLE)))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"decision": "coherent", "findings": []}
    assert proc.stderr == b""


def test_a_refused_population_exits_1_with_every_finding(tmp_path: Path) -> None:
    obs = json.loads(json.dumps(EXAMPLE))
    obs["returned_completely"] = False
    obs["participants"][1]["incarnation"] = "engine-9c01"
    obs["participants"][1]["host"] = "host-z"
    proc = _run("check", str(_write(tmp_path, obs)))
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["decision"] == "refused"
    assert out["findings"] == [
        {"kind": "participant_on_unselected_host", "global_rank": 1, "host": "host-z"},
        {"kind": "selected_host_carried_no_rank", "host": "host-b"},
        {"kind": "participant_from_another_incarnation", "global_rank": 1, "host": "host-z",
         "participant_incarnation": "engine-9c01", "observation_incarnation": "engine-7f3a"},
        {"kind": "observation_incomplete", "participant_count": 2},
    ]
    assert list(out) == ["decision", "findings"]
    assert all(list(f)[0] == "kind" for f in out["findings"])


def test_the_documented_finding_kinds_are_the_laws() -> None:
    kinds_table = DOC.split("| `kind` | other fields |", 1)[1].split("\n\n", 1)[0]
    documented_kinds = re.findall(r"^\| `([a-z_]+)` \|", kinds_table, flags=re.M)
    assert documented_kinds == list(FINDING_KINDS)


def test_stdin_is_read_with_a_dash() -> None:
    proc = _run("check", "-", stdin=json.dumps(EXAMPLE).encode())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["decision"] == "coherent"


def _mutated(**changes: Any) -> dict[str, Any]:
    obs = json.loads(json.dumps(EXAMPLE))
    for dotted, value in changes.items():
        target = obs
        *path, last = dotted.split("__")
        for step in path:
            target = target[int(step)] if step.isdigit() else target[step]
        target[last] = value
    return obs


INVALID_INPUTS: dict[str, tuple[str, str]] = {
    # name: (file text, a fragment the message must contain)
    "unknown top-level field": (json.dumps(_mutated(provenance="acquired")), "provenance: Extra inputs"),
    "unknown participant field": (json.dumps(_mutated(participants__0__pid=46055)), "participants.0.pid"),
    "string where an integer belongs": (json.dumps(_mutated(world_size="2")), "world_size"),
    "integer where a boolean belongs": (json.dumps(_mutated(returned_completely=1)), "returned_completely"),
    "boolean where an integer belongs": (json.dumps(_mutated(participants__1__global_rank=True)), "global_rank"),
    "integer process key": (json.dumps(_mutated(participants__0__host_local_worker_process_key=46055)),
                            "host_local_worker_process_key"),
    "fractional rank": (json.dumps(_mutated(participants__0__global_rank=0.5)), "global_rank"),
    "zero world size": (json.dumps(_mutated(world_size=0)), "world_size"),
    "empty host": (json.dumps(_mutated(participants__0__host="")), "participants.0.host"),
    "missing field": (json.dumps({k: v for k, v in EXAMPLE.items() if k != "incarnation"}), "incarnation"),
    "duplicate key": ('{"world_size": 2, "world_size": 3}', "duplicate object key"),
    "NaN": ('{"world_size": NaN}', "non-finite"),
    "not JSON": ("{not json", "not valid JSON"),
    "not an object": ("[1, 2]", "must be a JSON object"),
}


@pytest.mark.parametrize("name", sorted(INVALID_INPUTS))
def test_invalid_input_exits_2_with_a_message_and_no_traceback(tmp_path: Path, name: str) -> None:
    text, fragment = INVALID_INPUTS[name]
    result = CliRunner().invoke(app, ["check", str(_write(tmp_path, text))])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_non_utf8_bytes_are_invalid_input(tmp_path: Path) -> None:
    path = tmp_path / "observation.json"
    path.write_bytes(b'{"incarnation": "\xff"}')
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 2
    assert "not valid JSON" in result.stderr


def test_an_oversized_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "observation.json"
    path.write_bytes(b" " * (MAX_OBSERVATION_BYTES + 1))
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 2
    assert f"larger than the {MAX_OBSERVATION_BYTES}-byte limit" in result.stderr


def test_a_missing_file_exits_2_as_a_subprocess(tmp_path: Path) -> None:
    proc = _run("check", str(tmp_path / "absent.json"))
    assert proc.returncode == 2
    assert b"cannot read" in proc.stderr and b"No such file" in proc.stderr
    assert b"Traceback" not in proc.stderr
    assert proc.stdout == b""


def test_the_kiln_entry_point_routes_ranks_check(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "ranks", "check", str(_write(tmp_path, EXAMPLE))],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"decision": "coherent", "findings": []}


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--nproc-per-host", "0"], "nproc_per_host=0"),
        (["--nproc-per-host", "1", "--nnodes", "2", "--selected-host", "a"], "explicit master_port"),
        (["--nproc-per-host", "1", "--nnodes", "2", "--master-port", "29500"], "must name its selected hosts"),
        (["--nproc-per-host", "1", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"], "node_rank=2"),
        (["--nproc-per-host", "1", "--selected-host", ""], "selected host '' must be 1 to 256 characters"),
        (["--nproc-per-host", "1", "--timeout-s", "0"], "timeout_s=0.0"),
        (["--nproc-per-host", "1", "--nnodes", "2", "--master-port", "1", "--selected-host", "a"],
         "needs an explicit incarnation"),
        (["--nproc-per-host", "1", "--incarnation", ""], "incarnation '' must be 1 to 256 characters"),
        (["--nproc-per-host", "4", "--tensor-parallel-size", "3"], "3 does not divide 4"),
        (["--nproc-per-host", "4", "--pipeline-parallel-size", "3"], "3 does not divide 4"),
        (["--nproc-per-host", "2", "--pipeline-parallel-size", "0"], "pipeline_parallel_size=0"),
        (["--nproc-per-host", "2", "--tensor-parallel-size", "0"], "tensor_parallel_size=0"),
    ],
)
def test_observe_rejects_an_invalid_plan_with_exit_2(args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(app, ["observe", *args])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
