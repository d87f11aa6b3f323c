"""Teacher-only capture: exact teacher log-probabilities, identity refusals,
the child-process boundary (no student), resume reuse and `kiln distill status`."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.distill import shards
from kiln.distill.capture import CaptureRequest, LocalTeacherScorer, capture, run_capture_child
from kiln.distill.errors import ContractError

from tests.distill.tinymodels import capture_in_process, make_plan, synthetic_examples, tiny_pair  # noqa: F401

torch = pytest.importorskip("torch")


def _published(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if not p.name.startswith("."))


def _rows(out: Path):
    rows = []
    for shard in _published(out):
        verdict = shards.verify_shard(shard)
        assert verdict.ok and verdict.state == "available", verdict.problems
        for p in shards.read_manifest_chain(shard)[-1].payloads:
            rows += shards.parse_any_payload((shard / p.path).read_bytes(), p.path, verdict.plan)[0]
    return rows


@pytest.mark.parametrize("layout", ["packed", "jsonl"])
def test_capture_stores_the_teachers_exact_log_probabilities(tmp_path, tiny_pair, layout):
    teacher, student = tiny_pair
    examples = synthetic_examples(3, 32, prompt=3, target=4)
    plan_path, plan, data = make_plan(tmp_path, teacher, student, examples, top_k=3, max_len=5, widths=(4, 8, 8, 8))
    capture_in_process(tmp_path, teacher, plan_path, data, tmp_path / "run", layout=layout,
                       examples_per_shard=2, examples_per_payload=1)
    rows = _rows(tmp_path / "run")
    assert [(r.example_id, r.position) for r in rows] == [(e["example_id"], i) for e in examples for i in range(4)]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    for r in rows:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r.context_token_ids])).logits[0, -1].double()
        lp = torch.log_softmax(logits, -1)
        assert len(r.context_token_ids) <= 5  # left truncation at max_sequence_length
        assert list(r.top_k_ids) == torch.topk(lp, 3).indices.tolist()
        for i, got in zip(r.selected_ids, r.selected_logprobs):
            assert abs(got - lp[i].item()) < 1e-5  # float32 forward, float64 normalizer
        assert r.target_token_id in r.selected_ids and r.forced_ids == (r.target_token_id,)
        assert math.isclose(r.tail_mass, 1 - sum(math.exp(x) for x in r.selected_logprobs), abs_tol=1e-6)
        assert abs(r.entropy - float(-(lp.exp() * lp).sum())) < 1e-5


def test_teacher_identity_and_settings_mismatch_refuse_before_loading(tmp_path, tiny_pair, monkeypatch):
    teacher, student = tiny_pair
    ex = synthetic_examples(1, 32)
    _p, plan, _d = make_plan(tmp_path, teacher, student, ex, top_k=2)
    # The student is not the plan's teacher.
    with pytest.raises(ContractError, match="differs from the plan's teacher"):
        LocalTeacherScorer(plan, student, device="cpu")
    obj = plan.to_obj()
    for field, value, match in (("quantization", "config-sha256:" + "0" * 64, "quantization"),
                                ("backend_version", "0.0.1", "backend_version")):
        bad = json.loads(json.dumps(obj))
        bad["capture"][field] = value
        from kiln.distill.contract import Plan

        with pytest.raises(ContractError, match=match):
            LocalTeacherScorer(Plan.parse(bad), teacher, device="cpu")
    # Observed parameter dtypes must equal the declared dtype.
    import kiln.runtime.loader as loader

    real = loader.load_model

    def half_model(*a, **kw):
        lm = real(*a, **kw)
        lm.model.to(torch.bfloat16)
        return lm

    monkeypatch.setattr(loader, "load_model", half_model)
    with pytest.raises(ContractError, match="declares 'float32'"):
        LocalTeacherScorer(plan, teacher, device="cpu")


def test_capture_request_has_no_student_field():
    obj = CaptureRequest(plan="p", teacher="t", tokenizer="t", dataset_root="d", out="o").to_obj()
    assert "student" not in json.dumps(obj)
    with pytest.raises(ContractError, match="unknown fields"):
        CaptureRequest.from_obj({**obj, "student": "/models/student"})


def test_capture_runs_in_a_child_without_the_student_then_reuses(tmp_path, tiny_pair):
    teacher, student = tiny_pair
    moved = tmp_path / "student"
    shutil.copytree(student, moved)
    plan_path, plan, data = make_plan(tmp_path, teacher, moved, synthetic_examples(4, 32), top_k=4)
    shutil.rmtree(moved)  # the student is gone: capture must not need it
    out = tmp_path / "run"
    req = CaptureRequest(plan=str(plan_path), teacher=str(teacher), tokenizer=str(teacher), dataset_root=str(data),
                         out=str(out), device="cpu", examples_per_shard=2)
    receipt = capture(req, timeout=300)  # the controller: one fresh child process
    assert receipt["dtype"] == "float32" and receipt["quantization"] == "none"
    assert [s["decision"] for s in receipt["shards"]] == ["new", "new"]
    child = json.loads((out / ".receipts" / "capture-child.json").read_bytes())
    assert child["observed_dtypes"] == ["float32"] and child["declared_dtype"] == "float32"
    assert child["pid"] != os.getpid() and receipt["child_exit_code"] == 0
    from typer.testing import CliRunner

    from kiln.distill.cli import app

    status = CliRunner().invoke(app, ["status", str(out)])
    assert json.loads(status.stdout)["states"] == {"available": 2}
    before = {p: p.read_bytes() for p in out.rglob("*.kdpack")}
    again = run_capture_child(req)
    assert [s["decision"] for s in again["shards"]] == ["reuse", "reuse"]
    assert {p: p.read_bytes() for p in out.rglob("*.kdpack")} == before


def test_cli_capture_refusal_is_one_json_line(tmp_path, tiny_pair):
    teacher, student = tiny_pair
    plan_path, plan, data = make_plan(tmp_path, teacher, student, synthetic_examples(1, 32), top_k=2)
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "distill", "capture", str(plan_path), "--teacher", str(student),
         "--dataset-root", str(data), "--out", str(tmp_path / "run"), "--device", "cpu"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    err = json.loads(proc.stdout)["error"]
    assert "teacher" in err["message"] and proc.stdout.count("\n") == 1
    assert not [p for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")]


def test_worker_modules_import_no_heavy_runtime():
    code = ("import sys, kiln.distill.capture, kiln.distill.train, kiln.distill.binary, kiln.distill.local, "
            "kiln.distill.faults; print([m for m in ('torch','transformers','peft','numpy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
