"""Environment servers for the OpenEnv tests: tests/openenv/guess_env.py under uvicorn, one per mode."""

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
STARTUP_S = 240  # six openenv-core imports at once take minutes on a loaded 2-core machine


@pytest.fixture(scope="session")
def env_servers(tmp_path_factory):
    """``{mode: base_url}``; every server starts at once (each import of openenv-core takes seconds)."""
    logs = tmp_path_factory.mktemp("envlogs")
    procs, urls = [], {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for mode in MODES:
        port = free_port()
        log = open(logs / f"{mode}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.openenv.guess_env", str(port), mode],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        urls[mode] = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        for (mode, url), proc in zip(urls.items(), procs):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError((logs / f"{mode}.log").read_text(errors="replace"))
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"environment server {mode} did not start")
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
