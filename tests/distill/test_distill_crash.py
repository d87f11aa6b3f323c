"""kill -9 the capture worker and the trainer at every publication and ledger step.

Each case runs the real worker in a fresh Python process with
``KILN_DISTILL_FAULT=<point>``; it dies with ``os._exit(137)`` exactly there.
Afterwards only states the spec allows exist, no row is lost or duplicated, and
resuming finishes the run with the same result as an uninterrupted one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.canonical import atomic_write_bytes, canonical_json_bytes
from kiln.distill import shards
from kiln.distill.capture import CaptureRequest, run_capture_child
from kiln.distill.faults import CAPTURE_FAULT_POINTS, FAULT_ENV, FAULT_EXIT_CODE, TRAIN_FAULT_POINTS
from kiln.distill.ledger import Ledger
from kiln.distill.examples import available_shards
from kiln.distill.train import train_sparse_kd

from tests.distill.tinymodels import make_plan, synthetic_examples, tiny_pair  # noqa: F401

torch = pytest.importorskip("torch")

DEFAULT_LANE = {"capture_after_complete", "publish_after_rename", "train_after_checkpoint"}


def _lane(points):
    return [p if p in DEFAULT_LANE else pytest.param(p, marks=pytest.mark.slow) for p in points]


@pytest.fixture(scope="module")
def run_setup(tmp_path_factory, tiny_pair):
    teacher, student = tiny_pair
    tmp = tmp_path_factory.mktemp("crash")
    plan_path, plan, data = make_plan(tmp, teacher, student, synthetic_examples(4, 32, prompt=3, target=4), top_k=4)
    return teacher, student, plan_path, plan, data, tmp


def _request(setup, out: Path) -> CaptureRequest:
    teacher, _s, plan_path, _p, data, _t = setup
    return CaptureRequest(plan=str(plan_path), teacher=str(teacher), tokenizer=str(teacher), dataset_root=str(data),
                          out=str(out), device="cpu", examples_per_shard=2, examples_per_payload=1)


def _env(point: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if point:
        env[FAULT_ENV] = point
    return env


def _rows(out: Path):
    rows = []
    for shard in sorted(p for p in out.iterdir() if not p.name.startswith(".")):
        verdict = shards.verify_shard(shard)
        if verdict.state != "available":
            continue
        assert verdict.ok, verdict.problems
        for p in shards.read_manifest_chain(shard)[-1].payloads:
            rows += shards.parse_any_payload((shard / p.path).read_bytes(), p.path, verdict.plan)[0]
    return [(r.example_id, r.position, r.selected_ids, r.selected_logprobs) for r in rows]


@pytest.fixture(scope="module")
def reference_rows(run_setup):
    out = run_setup[5] / "reference-capture"
    run_capture_child(_request(run_setup, out))
    return _rows(out)


def _allowed_states(out: Path) -> None:
    for base, allowed in ((out, {"verified", "available"}), (out / ".staging", {"staging", "complete", "verified"})):
        if not base.is_dir():
            continue
        for txn in base.iterdir():
            if txn.name.startswith("."):
                continue
            head = shards.read_manifest_chain(txn)[-1]
            assert head.state in allowed, (txn, head.state)
            verdict = shards.verify_shard(txn)
            assert verdict.ok or head.state == "staging", verdict.problems


@pytest.mark.parametrize("point", _lane(CAPTURE_FAULT_POINTS))
def test_capture_killed_at_each_step_resumes_to_the_same_rows(point, run_setup, reference_rows, tmp_path):
    out = tmp_path / "run"
    req = _request(run_setup, out)
    out.mkdir()
    atomic_write_bytes(tmp_path / "req.json", canonical_json_bytes(req.to_obj()))
    proc = subprocess.run([sys.executable, "-m", "kiln.distill.capture", str(tmp_path / "req.json")],
                          env=_env(point), capture_output=True, text=True, timeout=300)
    assert proc.returncode == FAULT_EXIT_CODE, proc.stdout + proc.stderr
    _allowed_states(out)
    partial = _rows(out)
    assert len(set(partial)) == len(partial) and set(partial) <= set(reference_rows)
    receipt = run_capture_child(req)
    decisions = [s["decision"] for s in receipt["shards"]]
    assert _rows(out) == reference_rows  # nothing lost, nothing duplicated, same values
    staged = list((out / ".staging").iterdir()) if (out / ".staging").is_dir() else []
    assert all(shards.read_manifest_chain(t)[-1].state == "quarantined" for t in staged)
    expect = {
        "capture_after_complete": "verify-then-publish",
        "capture_after_verified": "publish",
        "publish_after_rename": "publish",
        "capture_after_available": "reuse",
        "capture_after_begin": "resume-staging",
        "capture_after_payload": "resume-staging",
        "capture_torn_payload": "resume-staging",
    }[point]
    assert decisions[0] == expect


def _capture_copy(setup, dest: Path) -> Path:
    """A copy of the reference capture with no consumption yet: ledgers live beside the capture
    (``.consumption``), so each trainer under test consumes its own copy."""
    import shutil

    shutil.copytree(setup[5] / "reference-capture", dest, ignore=shutil.ignore_patterns(".consumption"))
    return dest


def _train_child(setup, capture: Path, out: Path, point: str | None) -> subprocess.CompletedProcess:
    _t, student, _pp, _p, _d, tmp = setup
    code = ("import sys; from kiln.distill.train import train_sparse_kd; "
            "train_sparse_kd(sys.argv[1], sys.argv[2], sys.argv[3], batch_size=2)")
    return subprocess.run([sys.executable, "-c", code, str(capture), str(student), str(out)],
                          env=_env(point), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def reference_training(run_setup, reference_rows):
    out = run_setup[5] / "reference-train"
    capture = _capture_copy(run_setup, run_setup[5] / "reference-train-capture")
    result = train_sparse_kd(capture, run_setup[1], out, batch_size=2)
    from safetensors.torch import load_file

    return result, load_file(str(out / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("point", _lane(TRAIN_FAULT_POINTS))
def test_trainer_killed_at_each_step_consumes_once_and_matches(point, run_setup, reference_training, tmp_path):
    ref_result, ref_weights = reference_training
    out = tmp_path / "train"
    capture = _capture_copy(run_setup, tmp_path / "capture")
    if point == "train_after_release":  # needs an open reservation with no checkpoint first
        assert _train_child(run_setup, capture, out, "train_mid_shard").returncode == FAULT_EXIT_CODE
    proc = _train_child(run_setup, capture, out, point)
    assert proc.returncode == FAULT_EXIT_CODE, proc.stdout + proc.stderr
    plan, todo, _ = available_shards(capture)
    for shard_dir, head in todo:  # every ledger is a valid chain; nothing committed twice
        path = capture / ".consumption" / f"{head.transaction_id}.jsonl"
        if path.exists():
            assert Ledger(path, shard_dir, plan).view.commits <= 1
    result = train_sparse_kd(capture, run_setup[1], out, batch_size=2)
    actions = [s["action"] for s in result["shards"]]
    if point == "train_after_checkpoint":
        assert actions == ["reconciled", "trained"]  # committed from the checkpoint, not retrained
    elif point == "train_after_commit":
        assert actions == ["already-committed", "trained"]
    else:
        assert actions == ["trained", "trained"]
    assert result["steps"] == ref_result["steps"] and result["tokens"] == ref_result["tokens"]
    for shard_dir, head in todo:
        events = Ledger(capture / ".consumption" / f"{head.transaction_id}.jsonl", shard_dir, plan).events
        assert sum(e.action == "commit" for e in events) == 1
    from safetensors.torch import load_file

    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert set(weights) == set(ref_weights)
    for name, value in weights.items():
        assert torch.allclose(value, ref_weights[name], atol=1e-6, rtol=0), name
