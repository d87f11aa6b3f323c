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
    """Run ``kiln distill ARGS``; every outcome is exactly one JSON line on stdout, nothing on stderr."""
    out = subprocess.run([str(KILN), "distill", *args], capture_output=True, text=True, timeout=60, check=False)
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stderr == "", out.stderr
    assert out.stdout.count("\n") == 1 and out.stdout.endswith("\n"), out.stdout
    return out.returncode, json.loads(out.stdout)


def refused(*args: str) -> dict:
    rc, out = kiln(*args)
    assert rc == 2 and set(out) == {"error"} and out["error"]["code"] and out["error"]["message"], out
    return out["error"]


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
    [shard] = out["shards"]
    assert rc == 0 and shard["decision"] == "reuse" and shard["verdict"]["ok"] is True
    shard_dir = tmp_path / "s"
    shutil.copytree(FIXTURES / "shard-teacher-expert", shard_dir)
    payload = shard_dir / "payload" / "rows-00000.jsonl"
    payload.write_bytes(payload.read_bytes().replace(b'"position":0', b'"position":5'))
    rc, out = kiln("verify", str(shard_dir))
    [shard] = out["shards"]
    assert rc == 0 and shard["decision"] == "quarantine-and-restart" and shard["verdict"]["ok"] is False
    assert "SHA-256" in shard["verdict"]["problems"][0]
    assert shard["bytes_per_token"]["observed"] is None  # no observed size from bytes that failed verification
    # Another plan's shard is foreign: refused, never quarantined by this run.
    rc, out = kiln("verify", str(FIXTURES / "shard-teacher-expert"), "--plan-sha256", "0" * 64)
    assert rc == 0 and out["shards"][0]["decision"] == "refuse-foreign-run"
    assert out["shards"][0]["verdict"]["foreign"] is True
    assert refused("verify", str(tmp_path / "nope"))["code"] == "shard_error"


# --------------------------------------------- planned vs observed bytes/token


def test_verify_reports_planned_and_observed_bytes_per_token(expert_plan) -> None:
    rc, out = kiln("verify", str(FIXTURES / "shard-teacher-expert"))
    assert rc == 0
    # Fixture: N = 2, V = 3, S_max = 2, all widths 4 bytes; 782 payload bytes over 2 tokens.
    per_token = {
        "planned_sparse_upper": 2 * (4 + 4) + 4 + 4,
        "planned_dense": 3 * 4,
        "planned_excludes_metadata": True,
        "observed": 782 / 2,
        "observed_bytes": 782,
        "observed_tokens": 2,
    }
    assert out["shards"][0]["bytes_per_token"] == per_token
    assert out["run"] == {
        "plan_sha256": expert_plan.digest(),
        "shards": 1,
        "shards_counted": 1,
        "planned_tokens": 2,
        "planned_sparse_upper_bytes": 48,
        "planned_dense_bytes": 24,
        "bytes_per_token": per_token,
        "problems": [],
        "complete": True,  # the one shard covers every planned example once
    }


def test_verify_reports_every_shard_and_the_run_of_a_publication_root(tmp_path: Path, expert_plan, expert_rows) -> None:
    from kiln.distill import shards

    root = tmp_path / "run"
    shards.capture_shard(root, expert_plan, "s0", "t0", {"rows-00000.jsonl": expert_rows})
    shards.capture_shard(root, expert_plan, "s1", "t1", {"rows-00000.jsonl": expert_rows[:1]})
    shards.begin(root, expert_plan, "s2", "t2")  # staging: hidden under .staging, never scanned
    one_row = len(expert_rows[0].canonical_bytes()) + 1
    rc, out = kiln("verify", str(root))
    assert rc == 0
    assert [s["verdict"]["transaction_id"] for s in out["shards"]] == ["t0", "t1"]
    assert [s["bytes_per_token"]["observed"] for s in out["shards"]] == [782 / 2, one_row / 1]
    run = out["run"]
    assert (run["shards"], run["shards_counted"]) == (2, 2)
    # s1 holds an example s0 holds too: duplicate records fail closed, and the run observes more tokens than
    # the plan has (autodistill v1: resume never duplicates a committed prefix)
    assert len(run["problems"]) == 2 and "held by more than one shard" in run["problems"][0], run["problems"]
    assert "exceed the plan's planned_tokens" in run["problems"][1] and run["complete"] is False
    assert run["bytes_per_token"]["observed_bytes"] == 782 + one_row
    assert run["bytes_per_token"]["observed_tokens"] == 3
    assert run["bytes_per_token"]["observed"] == (782 + one_row) / 3
    assert run["bytes_per_token"]["planned_sparse_upper"] == 24
    # A quarantined shard is reported but not counted in the run.
    shards.quarantine(root / "t1", "operator found bit rot")
    rc, out = kiln("verify", str(root / "t0"), str(root / "t1"), str(root / "t0"))  # t0 twice: read once
    assert rc == 0 and len(out["shards"]) == 2
    assert out["run"]["shards_counted"] == 1 and out["run"]["bytes_per_token"]["observed"] == 782 / 2
    assert "not counted" in out["run"]["problems"][0]


def test_verify_names_a_mixed_run(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    root.mkdir()
    shutil.copytree(FIXTURES / "shard-teacher-expert", root / "a")
    shutil.copytree(FIXTURES / "shard-student-rollout", root / "b")
    rc, out = kiln("verify", str(root))
    assert rc == 0 and all(s["verdict"]["ok"] for s in out["shards"])
    assert out["run"]["plan_sha256"] is None and out["run"]["bytes_per_token"]["planned_dense"] is None
    assert "mixed run" in out["run"]["problems"][0]


# ------------------------------------------------ every path refuses in one line


def test_estimate_overflowing_seconds_is_a_refusal_not_a_traceback() -> None:
    args = ["--tokens", "10000000000000", "--vocab-size", "3", "--top-k", "1", "--max-forced", "1",
            "--id-bytes", "4", "--logprob-bytes", "4", "--tail-bytes", "4", "--entropy-bytes", "4"]
    err = refused("estimate", *args, "--throughput-min", "1e-300", "--throughput-max", "1")
    assert err["code"] == "invalid_estimate" and "Infinity" in err["message"]


def test_estimate_of_a_realistic_plan_prints_exact_integers() -> None:
    args = ["--tokens", str(10**10), "--vocab-size", "152064", "--top-k", "64", "--max-forced", "1",
            "--id-bytes", "4", "--logprob-bytes", "2", "--tail-bytes", "4", "--entropy-bytes", "4"]
    out = subprocess.run([str(KILN), "distill", "estimate", *args], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout
    assert f'"dense_bytes": {10**10 * 152064 * 2}' in out.stdout  # 3041280000000000, digit for digit
    assert json.loads(out.stdout)["sparse_upper_bytes"] == 10**10 * (65 * 6 + 8)


def _cfg(tmp_path: Path) -> Path:
    config = json.loads((FIXTURES / "plan.json").read_bytes())
    del config["estimate"]
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    return tmp_path / "cfg.json"


BAD_INPUTS = {
    "group: no command": lambda t: [],
    "group: unknown command": lambda t: ["nope"],
    "group: unknown option": lambda t: ["--bogus"],
    "estimate: no options": lambda t: ["estimate"],
    "estimate: unknown option": lambda t: ["estimate", *ESTIMATE, "--bogus", "1"],
    "estimate: option without value": lambda t: ["estimate", *ESTIMATE, "--throughput-min"],
    "estimate: negative tokens": lambda t: ["estimate", *ESTIMATE[2:], "--tokens", "-1"],
    "estimate: float tokens": lambda t: ["estimate", *ESTIMATE[2:], "--tokens", "1e3"],
    "estimate: zero rate": lambda t: ["estimate", *ESTIMATE, "--throughput-min", "1e-400", "--throughput-max", "1"],
    "estimate: infinite rate": lambda t: ["estimate", *ESTIMATE, "--throughput-min", "1", "--throughput-max", "inf"],
    "estimate: subnormal rate": lambda t: ["estimate", *ESTIMATE, "--throughput-min", "5e-324", "--throughput-max", "1"],
    "c14n: missing file argument": lambda t: ["c14n"],
    "c14n: two files": lambda t: ["c14n", str(t / "a"), str(t / "b")],
    "c14n: a directory": lambda t: ["c14n", str(t)],
    "c14n: not UTF-8": lambda t: (t / "bin.jsonl").write_bytes(b'{"a":"\xff"}\n') and ["c14n", str(t / "bin.jsonl")],
    "c14n: not JSON": lambda t: (t / "x.jsonl").write_bytes(b"{nope}\n") and ["c14n", str(t / "x.jsonl")],
    "plan: no options": lambda t: ["plan"],
    "plan: missing config file": lambda t: ["plan", "--config", str(t / "none.json"), "--out", str(t / "run")],
    "plan: config is an array": lambda t: (t / "a.json").write_text("[]") and [
        "plan", "--config", str(t / "a.json"), "--out", str(t / "run")],
    "plan: config is not JSON": lambda t: (t / "b.json").write_text("{") and [
        "plan", "--config", str(t / "b.json"), "--out", str(t / "run")],
    "plan: NaN in config": lambda t: (t / "n.json").write_text('{"run_id": NaN}') and [
        "plan", "--config", str(t / "n.json"), "--out", str(t / "run")],
    "plan: out is a file": lambda t: (t / "file").write_text("x") and [
        "plan", "--config", str(_cfg(t)), "--out", str(t / "file")],
    "plan: huge throughput overflow": lambda t: ["plan", "--config", str(_tiny_rate_cfg(t)), "--out", str(t / "run")],
    "verify: no path": lambda t: ["verify"],
    "verify: missing path": lambda t: ["verify", str(t / "missing")],
    "verify: a file": lambda t: (t / "f").write_text("x") and ["verify", str(t / "f")],
    "verify: malformed plan hash": lambda t: ["verify", str(FIXTURES / "shard-teacher-expert"), "--plan-sha256", "xyz"],
    "verify: unknown option": lambda t: ["verify", str(FIXTURES / "shard-teacher-expert"), "--bogus"],
}


def _tiny_rate_cfg(tmp_path: Path) -> Path:
    from kiln.distill.contract import Plan, ThroughputProfile

    config = json.loads((FIXTURES / "plan.json").read_bytes())
    del config["estimate"]
    plan = Plan.parse((FIXTURES / "plan.json").read_bytes())
    profile = {
        "backend": plan.capture.backend, "teacher_fingerprint_sha256": plan.teacher.digest(),
        "dtype": plan.capture.dtype, "quantization": plan.capture.quantization, "sequence_length_min": 1,
        "sequence_length_max": 64, "hardware_class": "cpu", "tokens_per_second_min": 5e-324,
        "tokens_per_second_max": 1.0,
    }
    config["throughput_profile"] = profile
    config["throughput_profile_sha256"] = ThroughputProfile.parse(profile).digest()
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    return tmp_path / "tiny.json"


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path: Path, case: str) -> None:
    err = refused(*BAD_INPUTS[case](tmp_path))
    assert "\n" not in err["message"]
    assert not (tmp_path / "run" / "plan.json").exists()
