"""Issue item 4: a web page cannot drive the server (cross-origin, simple content types, DNS rebinding), and
the optional bearer key.

Browser-style requests are replayed with httpx: what a page's ``fetch``/form can send
(``Origin``, ``Content-Type: text/plain``, a foreign ``Host`` after DNS rebinding).
"""

from __future__ import annotations

import io
import tarfile

import httpx
import pytest

from tests.security.conftest import API_KEY, GOOD_ORIGIN

EVIL = "http://evil.example"


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code", "hint"}
    assert body["error"]["code"] == code, body
    return body["error"]


def _tiny_archive() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"{}"
        info = tarfile.TarInfo("x/adapter_config.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_cross_origin_text_plain_cannot_load_or_upload(client, secure_server):
    before = client.get("/v1/adapters").json()
    headers = {"Origin": EVIL, "Content-Type": "text/plain"}
    _error(client.post("/v1/adapters/victim/load", headers=headers), 403, "origin_not_allowed")
    _error(client.post("/v1/adapters/victim/upload", content=_tiny_archive(), headers=headers), 403,
           "origin_not_allowed")
    _error(client.post("/v1/train/sft", content=b'{"adapter": "x"}', headers=headers), 403, "origin_not_allowed")
    _error(client.delete("/v1/adapters/victim", headers={"Origin": EVIL}), 403, "origin_not_allowed")
    assert client.get("/v1/adapters").json() == before


def test_cross_origin_json_generation_is_refused(client, secure_server):
    body = {"model": secure_server.model_id, "prompt": "hi", "max_tokens": 1}
    _error(client.post("/v1/completions", json=body, headers={"Origin": EVIL}), 403, "origin_not_allowed")
    _error(client.post("/v1/completions", json=body, headers={"Origin": "null"}), 403, "origin_not_allowed")


def test_same_origin_page_is_allowed(client, secure_server):
    body = {"model": secure_server.model_id, "prompt": "hi", "max_tokens": 1}
    r = client.post("/v1/completions", json=body, headers={"Origin": secure_server.base_url})
    assert r.status_code == 200, r.text
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_simple_content_types_are_415(client, secure_server, ctype):
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % secure_server.model_id.encode()
    _error(client.post("/v1/completions", content=body, headers={"Content-Type": ctype}), 415,
           "unsupported_media_type")
    _error(client.post("/v1/adapters/victim/upload", content=_tiny_archive(), headers={"Content-Type": ctype}), 415,
           "unsupported_media_type")


def test_json_without_content_type_is_415(client, secure_server):
    r = client.post("/v1/train/sft", content=b'{"adapter": "x"}', headers={"Content-Type": ""})
    _error(r, 415, "unsupported_media_type")


def test_upload_accepts_the_archive_type(client):
    r = client.post("/v1/adapters/victim/upload", content=_tiny_archive(),
                    headers={"Content-Type": "application/gzip"})
    assert r.status_code == 400, r.text  # past the middleware: the archive itself is rejected


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8420", "rebind.attacker.test"])
def test_foreign_host_is_refused(secure_server, host):
    r = httpx.get(f"{secure_server.base_url}/v1/models", headers={"Host": host})
    _error(r, 403, "host_not_allowed")
    r = httpx.post(f"{secure_server.base_url}/v1/adapters/x/load", headers={"Host": host})
    _error(r, 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "LOCALHOST:1234"])
def test_local_hosts_are_accepted(secure_server, host):
    assert httpx.get(f"{secure_server.base_url}/v1/models", headers={"Host": host}).status_code == 200


def _raw(server, head: bytes) -> bytes:
    """Send a raw request head (no body) and return the status line."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while b"\r\n" not in data and (chunk := sock.recv(4096)):
            data += chunk
    return data.split(b"\r\n", 1)[0]


def test_host_header_must_be_single_and_present(secure_server):
    """Only the first of two Host headers was checked, and HTTP/1.1 without Host was served."""
    for head in (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
                 b"GET /v1/models HTTP/1.1\r\nHost: evil.example\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                 b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n"):
        assert _raw(secure_server, head).startswith(b"HTTP/1.1 400"), head
    assert _raw(secure_server, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n") \
        .startswith(b"HTTP/1.1 200")


def test_same_origin_means_the_same_scheme(secure_server):
    host = secure_server.base_url.split("://", 1)[1]
    body = {"model": secure_server.model_id, "prompt": "hi", "max_tokens": 1}
    r = httpx.post(f"{secure_server.base_url}/v1/completions", json=body, headers={"Origin": f"https://{host}"})
    _error(r, 403, "origin_not_allowed")
    ok = httpx.post(f"{secure_server.base_url}/v1/completions", json=body, headers={"Origin": f"http://{host}"})
    assert ok.status_code == 200, ok.text


def test_no_cors_unless_configured(secure_server):
    pre = httpx.options(f"{secure_server.base_url}/v1/chat/completions",
                        headers={"Origin": EVIL, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "content-type"})
    _error(pre, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in pre.headers
    r = httpx.get(f"{secure_server.base_url}/v1/models", headers={"Origin": EVIL})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# -- bearer key ------------------------------------------------------------------------


def test_api_key_required(auth_server):
    base = auth_server.base_url
    r = httpx.get(f"{base}/v1/models")
    _error(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    _error(httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
    _error(httpx.get(f"{base}/openapi.json"), 401, "unauthorized")
    ok = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200  # probes need no key


def test_the_kiln_cli_sends_KILN_API_KEY(auth_server):
    """The client commands (`kiln adapters`, `kiln train`, `kiln judgments`, ...) send `KILN_API_KEY` as the
    bearer token; without it they exit 1 with the server's 401 and a hint naming the variable."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"} | {"COLUMNS": "200"}
    args = [sys.executable, "-m", "kiln.cli", "adapters", "list", "--url", auth_server.base_url]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 1 and "401 unauthorized" in refused.stderr and "KILN_API_KEY" in refused.stderr
    ok = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env | {"KILN_API_KEY": API_KEY})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    export = subprocess.run([sys.executable, "-m", "kiln.cli", "judgments", "export", "--url", auth_server.base_url],
                            capture_output=True, text=True, timeout=120, env=env | {"KILN_API_KEY": API_KEY})
    assert export.returncode == 0 and export.stdout == "", export.stdout + export.stderr
    wrong = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env | {"KILN_API_KEY": "wrong"})
    assert wrong.returncode == 1 and "401 unauthorized" in wrong.stderr


def test_only_the_dashboards_static_shell_is_open_without_the_key(auth_server):
    """As docs/serving.md says: the shell (package HTML/JS/CSS) loads without the key and holds no
    server data (no model ID, no base-model hash); every API call it makes needs the key."""
    base = auth_server.base_url
    shell = httpx.get(f"{base}/ui/")
    assert shell.status_code == 200 and "text/html" in shell.headers["content-type"]
    health = httpx.get(f"{base}/health").json()
    for secret in (auth_server.model_id, health.get("base_model_sha256") or auth_server.model_id, API_KEY):
        assert secret not in shell.text
    for path in ("/v1/models", "/v1/adapters", "/v1/train/jobs", "/v1/config", "/metrics"):
        _error(httpx.get(f"{base}{path}"), 401, "unauthorized")
    _error(httpx.post(f"{base}/ui/", json={}), 401, "unauthorized")  # only GET/HEAD of the shell are open


def test_api_key_covers_the_fast_path(auth_server):
    body = {"model": auth_server.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _error(httpx.post(f"{auth_server.base_url}/v1/chat/completions", json=body), 401, "unauthorized")


def test_openai_client_with_key(auth_server):
    from openai import AuthenticationError, OpenAI

    good = OpenAI(base_url=f"{auth_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    out = good.chat.completions.create(model=auth_server.model_id, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content is not None
    bad = OpenAI(base_url=f"{auth_server.base_url}/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(AuthenticationError):
        bad.models.list()


def test_configured_origin_gets_cors(auth_server):
    base = auth_server.base_url
    pre = httpx.options(f"{base}/v1/chat/completions",
                        headers={"Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == GOOD_ORIGIN
    body = {"model": auth_server.model_id, "prompt": "hi", "max_tokens": 1}
    r = httpx.post(f"{base}/v1/completions", json=body,
                   headers={"Origin": GOOD_ORIGIN, "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == GOOD_ORIGIN
    _error(httpx.post(f"{base}/v1/completions", json=body,
                      headers={"Origin": EVIL, "Authorization": f"Bearer {API_KEY}"}), 403, "origin_not_allowed")


def test_api_key_env_must_be_set():
    from kiln.config import ServerSettings
    from kiln.serving.security import ApiKeyMissing, SecurityPolicy

    server = ServerSettings(api_key_env="KILN_TEST_UNSET_KEY_VAR")
    with pytest.raises(ApiKeyMissing, match="KILN_TEST_UNSET_KEY_VAR"):
        SecurityPolicy.from_settings(server, environ={})
    assert SecurityPolicy.from_settings(server, environ={"KILN_TEST_UNSET_KEY_VAR": "k"}).api_key == "k"
