"""Environment servers for the OpenEnv tests: tests/openenv/guess_env.py under uvicorn, one app per mode."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
MODES = ("guess", "counter", "error", "slow", "huge", "drift")
STARTUP_S = 240  # an openenv-core import takes a minute on a loaded 2-core machine


@pytest.fixture(scope="session")
def env_servers(tmp_path_factory):
    """``{mode: base_url}``: one process serves every mode, each on its own port (openenv-core imports
    gradio, seconds of CPU per process)."""
    log_path = tmp_path_factory.mktemp("envlogs") / "guess_env.log"
    urls = {mode: f"http://127.0.0.1:{free_port()}" for mode in MODES}
    pairs = [f"{url.rsplit(':', 1)[1]}:{mode}" for mode, url in urls.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.openenv.guess_env", *pairs],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        for mode, url in urls.items():
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(log_path.read_text(errors="replace"))
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"environment server {mode} did not start:\n{log_path.read_text(errors='replace')}")
                time.sleep(0.1)
        yield urls
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
