"""`kiln distill` through real subprocesses of the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.distill.conftest import FIXTURES

KILN = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kiln"

pytestmark = pytest.mark.skipif(not KILN.exists(), reason="the venv's kiln script is not installed")


def kiln(*args: str) -> tuple[int, dict]:
    out = subprocess.run([str(KILN), "distill", *args], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stdout + out.stderr
    return out.returncode, json.loads(out.stdout)


ESTIMATE = ["--tokens", "1000", "--vocab-size", "151936", "--top-k", "64", "--max-forced", "1",
            "--id-bytes", "4", "--logprob-bytes", "2", "--tail-bytes", "4", "--entropy-bytes", "4"]


def test_estimate_without_profile_has_no_seconds() -> None:
    rc, out = kiln("estimate", *ESTIMATE)
    assert rc == 0
    assert out == {
        "dense_bytes": 1000 * 151936 * 2,
        "sparse_ids_max": 65,
        "sparse_upper_bytes": 1000 * (65 * (4 + 2) + 4 + 4),
        "seconds_min": None,
        "seconds_max": None,
        "excludes_metadata": True,
    }


def test_estimate_with_measured_profile() -> None:
    rc, out = kiln("estimate", *ESTIMATE, "--throughput-min", "250", "--throughput-max", "1000")
    assert rc == 0 and (out["seconds_min"], out["seconds_max"]) == (1.0, 4.0)
    rc, out = kiln("estimate", "--tokens", "4", "--vocab-size", "3", "--top-k", "3", "--max-forced", "1",
                   "--id-bytes", "4", "--logprob-bytes", "4", "--tail-bytes", "4", "--entropy-bytes", "4")
    assert rc == 0 and out["sparse_ids_max"] == 3  # min(V, K + F)


@pytest.mark.parametrize(
    "args,code",
    [
        (["--tokens", "ten"], "invalid_option"),
        (ESTIMATE[:-2], "missing_option"),
        (ESTIMATE + ["--throughput-min", "5"], "invalid_estimate"),
        (ESTIMATE + ["--throughput-min", "5", "--throughput-max", "1"], "invalid_estimate"),
        (ESTIMATE + ["--throughput-min", "nan", "--throughput-max", "1"], "invalid_option"),
        (["--tokens", "1", "--vocab-size", "3", "--top-k", "4", "--max-forced", "1", "--id-bytes", "4",
          "--logprob-bytes", "4", "--tail-bytes", "4", "--entropy-bytes", "4"], "invalid_estimate"),
    ],
)
def test_estimate_refusals(args: list[str], code: str) -> None:
    rc, out = kiln("estimate", *args)
    assert rc == 2 and out["error"]["code"] == code and out["error"]["message"]


def test_c14n_reports_source_and_normalized_hashes(tmp_path: Path) -> None:
    src = tmp_path / "rows.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"b":1, "a":2}\r\n{"c":[1, 2]}\r\n')
    rc, out = kiln("c14n", str(src))
    assert rc == 0 and out["rows"] == 2
    import hashlib

    assert out["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert out["normalized_sha256"] == hashlib.sha256(b'{"a":2,"b":1}\n{"c":[1,2]}\n').hexdigest()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"a":1}\n\n')
    rc, out = kiln("c14n", str(bad))
    assert rc == 2 and out["error"]["code"] == "invalid_jsonl" and "blank" in out["error"]["message"]
    rc, out = kiln("c14n", str(tmp_path / "missing.jsonl"))
    assert rc == 2 and out["error"]["code"] == "not_found"


def test_plan_writes_canonical_plan(tmp_path: Path) -> None:
    config = json.loads((FIXTURES / "plan.json").read_bytes())
    del config["estimate"], config["schema"]
    (tmp_path / "cfg.json").write_text(json.dumps(config, indent=2))
    rc, out = kiln("plan", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "run"))
    assert rc == 0
    written = (tmp_path / "run" / "plan.json").read_bytes()
    assert written == (FIXTURES / "plan.json").read_bytes()
    import hashlib

    assert out["plan_sha256"] == hashlib.sha256(written).hexdigest()
    # Same config again is idempotent; a changed one is a different run.
    assert kiln("plan", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "run"))[0] == 0
    config["capture"]["planned_tokens"] = 3
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    rc, out = kiln("plan", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "run"))
    assert rc == 2 and out["error"]["code"] == "plan_exists"


@pytest.mark.parametrize(
    "mutate,code",
    [
        (lambda c: c["probability"].pop("top_k"), "invalid_artifact"),
        (lambda c: c.update(estimate={"dense_bytes": 1}), "invalid_estimate"),
        (lambda c: c.update(schema="soup.autodistill.plan.v9"), "unknown_schema"),
    ],
)
def test_plan_refusals(tmp_path: Path, mutate, code: str) -> None:
    config = json.loads((FIXTURES / "plan.json").read_bytes())
    del config["estimate"]
    mutate(config)
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    rc, out = kiln("plan", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "run"))
    assert rc == 2 and out["error"]["code"] == code
    assert not (tmp_path / "run" / "plan.json").exists()
    (tmp_path / "dup.json").write_text('{"run_id": "a", "run_id": "b"}')
    rc, out = kiln("plan", "--config", str(tmp_path / "dup.json"), "--out", str(tmp_path / "run"))
    assert rc == 2 and "duplicate" in out["error"]["message"]


def test_verify_prints_verdict_and_decision(tmp_path: Path) -> None:
    rc, out = kiln("verify", str(FIXTURES / "shard-teacher-expert"))
    assert rc == 0 and out["decision"] == "reuse" and out["verdict"]["ok"] is True
    shard = tmp_path / "s"
    shutil.copytree(FIXTURES / "shard-teacher-expert", shard)
    payload = shard / "payload" / "rows-00000.jsonl"
    payload.write_bytes(payload.read_bytes().replace(b'"position":0', b'"position":5'))
    rc, out = kiln("verify", str(shard))
    assert rc == 0 and out["decision"] == "quarantine-and-restart" and out["verdict"]["ok"] is False
    assert "SHA-256" in out["verdict"]["problems"][0]
    rc, out = kiln("verify", str(FIXTURES / "shard-teacher-expert"), "--plan-sha256", "0" * 64)
    assert rc == 0 and out["decision"] == "quarantine-and-restart"
    rc, out = kiln("verify", str(tmp_path / "nope"))
    assert rc == 2 and out["error"]["code"] == "shard_error"
