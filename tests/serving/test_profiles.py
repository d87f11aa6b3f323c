"""Serving profiles: ``stable`` serves and refuses training and experimental routes (real ``kiln serve``)."""

from __future__ import annotations

import subprocess

import httpx

from tests.serving.conftest import KILN, start_server, stop_server


def test_stable_profile_serves_and_refuses_training_and_merges(builtin_model_dir, tmp_path):
    srv = start_server(builtin_model_dir, tmp_path / "home", extra_args=["--threads", "1", "--profile", "stable"],
                       env_extra={}, config=None, log_dir=tmp_path)
    try:
        cfg = httpx.get(f"{srv.base_url}/v1/config").json()
        assert cfg["settings"]["serving.profile"] == {"value": "stable", "source": "cli"}
        assert cfg["effective"]["profile"] == "stable" and cfg["effective"]["training_enabled"] is False
        assert cfg["settings"]["training.enabled"] == {"value": False, "source": "serving.profile"}
        chat = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "model": srv.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200
        for path, body in (("/v1/train/sft", {"adapter": "a", "examples": [{"messages": [
                                {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]}),
                           ("/v1/adapters/merge", {"name": "m", "method": "linear",
                                                   "adapters": [{"name": "a", "weight": 1.0}]})):
            r = httpx.post(f"{srv.base_url}{path}", json=body, timeout=60)
            assert r.status_code == 403 and r.json()["error"]["code"] == "stable_profile", (path, r.text)
    finally:
        stop_server(srv)


def test_stable_profile_with_training_explicitly_on_stops_start_up(builtin_model_dir, tmp_path):
    out = subprocess.run([str(KILN), "serve", "--model", str(builtin_model_dir), "--port", "1",
                          "--profile", "stable", "--training"], capture_output=True, text=True, timeout=120,
                         env={"KILN_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "serving.profile = stable refuses training" in out.stderr and "training.enabled" in out.stderr
