"""One real ``kiln serve`` subprocess shared by the serving tests.

It is started with settings from all three layers so the config-precedence test
can read them back from GET /v1/config: the TOML file sets three keys, the
environment overrides two of them, and a CLI flag overrides one of those again.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.zygote import popen

STARTUP_TIMEOUT_S = 120
KILN = Path(sys.executable).with_name("kiln")

CONFIG_TOML = """
[server]
request_timeout_s = 120.0

[batching]
token_budget = 300
max_queued_rows = 200

[limits]
max_n = 5
max_tokens_cap = 480
"""
ENV_OVERRIDES = {"KILN_BATCHING_TOKEN_BUDGET": "320", "KILN_LIMITS_MAX_N": "6"}
CLI_FLAGS = ["--token-budget", "384", "--max-model-len", "512", "--no-training"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen
    model_id: str
    model_dir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(model_dir: Path, home: Path, *, extra_args: list[str], env_extra: dict[str, str],
                 config: Path | None, log_dir: Path | None = None) -> Server:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(env_extra)
    env["KILN_HOME"] = str(home)
    args = [str(KILN), "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *extra_args]
    if config is not None:
        args += ["--config", str(config)]
    log_dir = log_dir or home
    log_path = log_dir / f"serve-{port}.log"
    log = open(log_path, "wb")
    proc = popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir)  # tests.zygote: forked
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return Server(base, proc, model_dir.name, model_dir, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"kiln serve did not become healthy:\n{log_path.read_text(errors='replace')}")


def stop_server(server: Server) -> int:
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


@pytest.fixture(scope="session")
def server(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-home")
    config = home / "kiln.toml"
    config.write_text(CONFIG_TOML)
    srv = start_server(builtin_model_dir, home, extra_args=CLI_FLAGS, env_extra=ENV_OVERRIDES, config=config)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def openapi_checker(server):
    from tests.security.openapi_check import fetch_checker

    return fetch_checker(server.base_url)


@pytest.fixture
def http(server, openapi_checker):
    """Every response is checked against the server's /openapi.json (status, media type, body schema)."""
    from tests.security.openapi_check import checked_client

    with checked_client(server.base_url, openapi_checker) as client:
        yield client


@pytest.fixture
def oai(server, openapi_checker):
    from openai import OpenAI

    def check(response):  # streamed responses are read by the SDK itself; tests/security covers SSE events
        if "text/event-stream" not in response.headers.get("content-type", ""):
            openapi_checker.check_httpx(response)

    client = httpx.Client(timeout=60, event_hooks={"response": [check]})
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60, http_client=client)


OPS_MEMORY_BUDGET = 12_000_000  # bytes: room for a few MB beside the weights and the 2 MiB KV pool below
OPS_ENV = {
    "KILN_MODEL_DEVICE": "cpu",  # float32: the admission test's windows are sized for these bytes
    "KILN_LIMITS_MEMORY_BUDGET_BYTES": str(OPS_MEMORY_BUDGET),
    "KILN_BATCHING_KV_BUDGET_BYTES": str(2 << 20),
    "KILN_LIMITS_MAX_TOKENS_CAP": "128",
    "KILN_LIMITS_DEFAULT_MAX_TOKENS": "16",
    "KILN_SERVER_DEBUG_REQUESTS": "4",
    "KILN_SERVER_DEBUG_MODEL_STATE": "true",
}


@pytest.fixture(scope="session")
def ops_server(builtin_model_dir, tmp_path_factory):
    """A ``kiln serve`` with training on, a small memory budget (limits.memory_budget_bytes), the
    recent-request log (4 entries) and the debug model-state endpoint: memory admission and diagnostics."""
    home = tmp_path_factory.mktemp("kiln-ops")
    srv = start_server(builtin_model_dir, home, extra_args=["--threads", "1", "--max-model-len", "256"],
                       env_extra=OPS_ENV, config=None)
    yield srv
    stop_server(srv)
