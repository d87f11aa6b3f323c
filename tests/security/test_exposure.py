"""Issue item 6: private state directories and no absolute server paths in responses."""

from __future__ import annotations

import stat
import time

import pytest


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_dirs_are_private(secure_server):
    home = secure_server.home
    for d in (home, home / "training", home / "adapters", home / "data"):
        assert d.is_dir() and _mode(d) == 0o700, (d, oct(_mode(d)))


def test_startup_files_are_private(secure_server):
    created = [p for p in secure_server.home.rglob("*") if p.is_file()]
    assert any(p.name.startswith("jobs.sqlite3") for p in created), created
    loose = {str(p.relative_to(secure_server.home)): oct(_mode(p)) for p in created if _mode(p) & 0o077}
    assert not loose, loose


def test_existing_home_is_tightened(tmp_path):
    from kiln.config import load_settings
    from kiln.serving.state import secure_state_dirs

    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    settings = load_settings(cli={"home": str(home)}, environ={}).settings
    for d in secure_state_dirs(settings):
        assert _mode(d) == 0o700, d


def _no_server_paths(text: str, server) -> None:
    for secret in (str(server.home), str(server.model_dir), str(server.home.parent)):
        assert secret not in text, f"{secret} leaked in {text[:500]}"


def test_models_root_is_not_a_path(client, secure_server):
    r = client.get("/v1/models")
    _no_server_paths(r.text, secure_server)
    assert r.json()["data"][0]["root"] == secure_server.model_id


def test_job_result_has_no_absolute_path(client, secure_server):
    example = {"messages": [{"role": "user", "content": "Name?"}, {"role": "assistant", "content": "Kiln."}]}
    job = client.post("/v1/train/sft", json={"adapter": "exposure", "examples": [example], "max_steps": 2,
                                             "epochs": 1}).json()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = client.get(f"/v1/train/jobs/{job['id']}")
        if r.json()["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.5)
    body = r.json()
    assert body["state"] == "succeeded", body
    _no_server_paths(r.text, secure_server)
    assert body["result"]["path"].startswith("$KILN_ADAPTERS/exposure"), body["result"]
    _no_server_paths(client.get("/v1/train/status").text, secure_server)
    _no_server_paths(client.get("/v1/adapters/exposure").text, secure_server)


@pytest.fixture
def redacting_app(tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kiln.config import load_settings
    from kiln.errors import NotFound
    from kiln.serving.errors import install_error_handlers
    from kiln.serving.paths import PathRedactor

    home = tmp_path / "home"
    settings = load_settings(cli={"home": str(home)}, environ={}).settings
    app = FastAPI()
    install_error_handlers(app, PathRedactor.from_settings(settings, tmp_path / "model").text)

    @app.get("/boom")
    def boom():
        raise NotFound(f"adapter file {home}/adapters/a/adapter_model.safetensors is missing",
                       hint=f"check {tmp_path / 'model'}/config.json and {home}work/other")

    return TestClient(app), home, tmp_path


def test_error_messages_have_no_absolute_path(redacting_app):
    client, home, tmp = redacting_app
    err = client.get("/boom").json()["error"]
    assert err["message"] == "adapter file $KILN_ADAPTERS/a/adapter_model.safetensors is missing"
    assert err["hint"].startswith("check $KILN_MODEL/config.json and ")
    assert f"{home}work/other" in err["hint"]  # only whole path components are replaced


def test_expose_paths_keeps_them(tmp_path):
    from kiln.config import load_settings
    from kiln.serving.paths import PathRedactor

    settings = load_settings(cli={"home": str(tmp_path), "server.expose_paths": True}, environ={}).settings
    assert PathRedactor.from_settings(settings, None).text(f"{tmp_path}/x") == f"{tmp_path}/x"
