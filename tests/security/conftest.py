"""Servers for the security and contract reproductions (real ``kiln serve`` on 127.0.0.1).

``secure_server``: default security settings, training on, small generation
limits and short slow-client timeouts so the timeout tests finish quickly.
``auth_server``: a bearer key (``server.api_key_env``) and one allowed origin; the recent-request log
with text (``server.debug_requests_text``) and the debug model-state endpoint, both behind the key.
"""

from __future__ import annotations

import pytest

from tests.security.openapi_check import OpenAPIChecker, checked_client, fetch_checker
from tests.serving.conftest import start_server, stop_server

HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
API_KEY_VAR = "TEST_KILN_API_KEY"
API_KEY = "k-test-0123456789abcdef"
GOOD_ORIGIN = "http://good.example"

SECURE_ENV = {
    "KILN_SERVER_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    "KILN_SERVER_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
    "KILN_SERVER_KEEP_ALIVE_TIMEOUT_S": "2",
    "KILN_LIMITS_MAX_MODEL_LEN": "256",
    "KILN_LIMITS_MAX_TOKENS_CAP": "32",
    "KILN_LIMITS_DEFAULT_MAX_TOKENS": "16",
    "KILN_LIMITS_MAX_N": "4",
    "KILN_TRAINING_QUEUE_MAX": "4",
}


@pytest.fixture(scope="session")
def secure_server(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-secure-home") / "home"  # created by kiln serve itself
    home.parent.joinpath("logs").mkdir()
    srv = start_server(builtin_model_dir, home, extra_args=["--threads", "1"], env_extra=SECURE_ENV, config=None,
                       log_dir=home.parent / "logs")
    srv.home = home
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def auth_server(builtin_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-auth-home")
    env = {"KILN_SERVER_API_KEY_ENV": API_KEY_VAR, API_KEY_VAR: API_KEY, "KILN_SERVER_ALLOWED_ORIGINS": GOOD_ORIGIN,
           "KILN_SERVER_DEBUG_REQUESTS": "2", "KILN_SERVER_DEBUG_REQUESTS_TEXT": "true",
           "KILN_SERVER_DEBUG_MODEL_STATE": "true"}
    srv = start_server(builtin_model_dir, home, extra_args=["--no-training", "--threads", "1"], env_extra=env,
                       config=None)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def checker(secure_server) -> OpenAPIChecker:
    return fetch_checker(secure_server.base_url)


@pytest.fixture
def client(secure_server, checker):
    """httpx client whose every response is validated against /openapi.json."""
    with checked_client(secure_server.base_url, checker) as c:
        yield c
