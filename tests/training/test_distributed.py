"""Distributed LoRA training under torchrun (gloo on CPU), with real subprocesses.

* two processes train the same adapter as one process at the same global batch and seed;
* killing one rank (SIGKILL) fails the job cleanly (non-zero exit, a message that says what to do,
  nothing published), a resume with another world size is refused, and a resume with the same
  world size finishes with the adapter an uninterrupted job trains (slow lane).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [
        ("What is the colour of thing 0?", "Thing 0 is red."),
        ("What is the colour of thing 1?", "Thing 1 is green, like grass in spring."),
        ("What is the colour of thing 2?", "Thing 2 is blue."),
        ("Colour of thing 3, please?", "Teal."),
        ("What is the colour of thing 4?", "Thing 4 is amber."),
    ]
]
# 5 examples in global batches of 4: every epoch ends with a one-row batch, so rank 1's share of it is
# empty and it joins the all-reduce with zero gradients. A huge learned_margin keeps the greedy-margin
# check (a MIN all-reduce every 5 steps) running without ever stopping the job early. Packing (a speed
# option the distributed loop does not apply yet) is off on both sides, and so is the KL-to-base anchor (the
# distributed loop does not add it yet either).
REQUEST = {"adapter": "colours", "batch_size": 4, "seed": 3, "lora_rank": 4, "learning_rate": 0.01,
           "until_learned": True, "learned_margin": 100.0, "learned_check_every": 5, "packing": False,
           "anchor_weight": 0, "examples": EXAMPLES}
TOLERANCE = 1e-5
RUN_TIMEOUT_S = 300


def _env(builtin_model_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k in ("KILN_TEST_CACHE",)}
    env.update(OMP_NUM_THREADS="1", KILN_MODEL_THREADS="1", KILN_MODEL_PATH=str(builtin_model_dir),
               KILN_MODEL_DEVICE="cpu")
    for key in ("ATEN_CPU_CAPABILITY",):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _torchrun(nproc: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "kiln.training.run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S, check=False)


def _weights(result: dict) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(result["path"]) / "adapter_model.safetensors"))


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _result(home: Path, job_id: str) -> dict:
    return json.loads((home / "training" / "distributed" / job_id / "result.json").read_text())


@pytest.mark.parametrize("sharding", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_processes_train_the_adapter_one_process_trains(tmp_path, builtin_model_dir, monkeypatch, sharding):
    """DDP with micro-batches of one row (gradient accumulation over the rank's share), or FSDP."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST | {"epochs": 8, "max_steps": 16}))
    env = _env(builtin_model_dir)

    # One process: the module without torchrun, in this process; it trains with the server's own loop.
    from kiln.training.run import main

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    one_home, two_home = tmp_path / "one", tmp_path / "two"
    assert main(["--home", str(one_home), "--model", str(builtin_model_dir), "--request", str(request),
                 "--job-id", "job-0000000000000001"]) == 0
    one = _result(one_home, "job-0000000000000001")
    # A job ID names one job: running it again is refused and leaves the first job's record alone.
    assert main(["--home", str(one_home), "--model", str(builtin_model_dir), "--request", str(request),
                 "--job-id", "job-0000000000000001"]) == 2
    assert _result(one_home, "job-0000000000000001") == one

    extra = ["--micro-batch-size", "1"] if sharding == "ddp" else ["--fsdp"]
    run = _torchrun(2, ["--home", str(two_home), "--request", str(request), "--job-id", "job-0000000000000002",
                        *extra], env)
    assert run.returncode == 0, run.stderr[-3000:]
    two = json.loads(run.stdout.strip().splitlines()[-1])
    assert two == _result(two_home, "job-0000000000000002")

    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["report"]["steps"] == two["report"]["steps"] == 16
    assert one["report"]["tokens"] == two["report"]["tokens"]  # the same global batches
    assert two["report"]["greedy_margin"] == pytest.approx(one["report"]["greedy_margin"], abs=1e-3)
    assert two["report"]["final_loss"] == pytest.approx(one["report"]["final_loss"], abs=1e-4)
    diff = _max_abs_diff(_weights(one), _weights(two))
    print(f"max abs diff, 2 processes ({sharding}) vs 1, 16 steps: {diff:.3g}")
    assert diff <= TOLERANCE
    # Same plan, and the same manifest identity apart from the job that made it.
    status = [json.loads((h / "training" / "distributed" / j / "status.json").read_text())
              for h, j in ((one_home, "job-0000000000000001"), (two_home, "job-0000000000000002"))]
    assert status[0]["plan_sha256"] == status[1]["plan_sha256"]
    assert [s["state"] for s in status] == ["succeeded", "succeeded"]


# ------------------------------------------------------------------ kill and resume (slow)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _rank_pid(root: int, rank: int) -> int | None:
    """The torchrun worker of ``rank`` below process ``root`` (by its RANK environment variable)."""
    for pid in _descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b"\0".join(environ):
            return pid
    return None


def _kiln(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen[str]:
    kiln = Path(sys.executable).with_name("kiln")
    return subprocess.Popen([str(kiln), "train", "sft", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_killed_rank_fails_the_job_cleanly_and_a_resume_finishes_it(tmp_path, builtin_model_dir, sharding):
    from kiln.adapters.store import AdapterStore

    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    env = _env(builtin_model_dir)
    home = tmp_path / "home"
    args = ["-f", str(examples), "-a", "colours", "--epochs", "30", "--batch-size", "4", "--seed", "3",
            "--rank", "4", "--lr", "0.01", "--checkpoint-interval", "2", "--home", str(home)]
    if sharding == "fsdp":
        args.append("--fsdp")

    # 60 steps; SIGKILL rank 1 once a checkpoint at step 4 or later exists.
    proc = _kiln([*args, "--distributed", "2"], env)
    jobs = home / "training" / "distributed"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    killed = None
    while time.monotonic() < deadline and proc.poll() is None:
        steps = [int(p.name.split("-")[1]) for p in jobs.glob("job-*/checkpoints/step-*")]
        if steps and max(steps) >= 4:
            killed = _rank_pid(proc.pid, 1)
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
                break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert killed is not None, f"the job ended before rank 1 could be killed: {err[-2000:]}"
    assert proc.returncode != 0
    (job_dir,) = list(jobs.glob("job-*"))
    job_id = job_dir.name
    assert f"distributed job {job_id} failed" in err and "Nothing was published" in err, err[-3000:]
    assert f"--resume {job_id}" in err
    status = json.loads((job_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]
    store = AdapterStore(home / "adapters")
    assert store.list() == []  # nothing half-published
    assert not [p for p in (home / "adapters" / ".staging").iterdir() if not p.name.endswith(".lock")]

    # Another world size: refused, says why.
    other = _kiln([*args, "--distributed", "1", "--resume", job_id], env)
    _, err1 = other.communicate(timeout=RUN_TIMEOUT_S)
    assert other.returncode != 0 and "world size" in err1, err1[-3000:]
    assert store.list() == []

    # The same world size: finishes from the checkpoint.
    again = _kiln([*args, "--distributed", "2", "--resume", job_id], env)
    out2, err2 = again.communicate(timeout=RUN_TIMEOUT_S)
    assert again.returncode == 0, err2[-3000:]
    resumed = json.loads(out2.strip().splitlines()[-1])
    assert resumed["resumed_from_step"] >= 4 and resumed["report"]["steps"] == 60

    # An uninterrupted job with the same request, in a fresh home.
    fresh = [a if a != str(home) else str(tmp_path / "fresh") for a in args]
    whole = _kiln([*fresh, "--distributed", "2"], env)
    out3, err3 = whole.communicate(timeout=RUN_TIMEOUT_S)
    assert whole.returncode == 0, err3[-3000:]
    uninterrupted = json.loads(out3.strip().splitlines()[-1])
    diff = _max_abs_diff(_weights(resumed), _weights(uninterrupted))
    print(f"max abs diff, resumed vs uninterrupted ({sharding}, 2 processes, 60 steps): {diff:.3g}")
    assert diff <= TOLERANCE
    assert resumed["report"]["final_loss"] == pytest.approx(uninterrupted["report"]["final_loss"], abs=1e-5)


def test_other_kinds_refuse_distributed_clearly():
    from typer.testing import CliRunner

    from kiln.training.cli import app

    for kind, extra in (("grpo", ["-f", "x.jsonl"]), ("opd", ["-f", "x.jsonl", "-t", "teacher"]),
                        ("kd", ["--run", "runs/x"])):
        res = CliRunner().invoke(app, [kind, *extra, "-a", "a", "--distributed", "2"])
        assert res.exit_code != 0
        assert f"kiln train {kind} --distributed is not supported yet" in res.output


def test_run_refuses_bad_arguments_before_starting():
    from kiln.training.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--request", "r.json", "--resume", "not-a-job"])
    with pytest.raises(SystemExit):
        parse_args(["--request", "r.json", "--micro-batch-size", "0"])
