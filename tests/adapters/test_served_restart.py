"""The served adapter set survives a restart of ``kiln serve``, each adapter at the revision it served.

Before, active adapters came back inactive and clients that named them got 404 until someone
reloaded them. Real ``kiln serve`` subprocesses over one ``$KILN_HOME``, real uploads.
"""

from __future__ import annotations

import json
import stat

import httpx

from tests.adapters.conftest import upload_adapter
from tests.serving.conftest import start_server, stop_server


def _upload(srv, name: str, src, tmp_path) -> str:
    return upload_adapter(srv.base_url, name, src, tmp_path)


def test_served_adapters_come_back_pinned_and_broken_ones_are_reported(builtin_model_dir, make_lora, tmp_path):
    home = tmp_path / "home"
    args = ["--threads", "1", "--no-training"]
    srv = start_server(builtin_model_dir, home, extra_args=args, env_extra={}, config=None, log_dir=tmp_path)
    try:
        rev_a = _upload(srv, "alpha", make_lora(seed=41, scale=0.2), tmp_path)
        rev_b = _upload(srv, "beta", make_lora(seed=42, scale=0.2), tmp_path)
        for name in ("alpha", "beta"):
            assert httpx.post(f"{srv.base_url}/v1/adapters/{name}/load", timeout=60).status_code == 200
        newer = _upload(srv, "alpha", make_lora(seed=43, scale=0.2), tmp_path)  # HEAD moves; alpha serves rev_a
        assert newer != rev_a
        assert httpx.get(f"{srv.base_url}/health").json()["adapters"] == {"alpha": rev_a, "beta": rev_b}
    finally:
        stop_server(srv)
    served = home / "adapters" / ".served.json"
    assert json.loads(served.read_text())["adapters"] == {"alpha": rev_a, "beta": rev_b}
    assert stat.S_IMODE(served.stat().st_mode) == 0o600
    weights = home / "adapters" / "beta" / "revisions" / rev_b / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # beta no longer matches its manifest

    srv = start_server(builtin_model_dir, home, extra_args=args, env_extra={}, config=None, log_dir=tmp_path)
    try:
        health = httpx.get(f"{srv.base_url}/health").json()
        assert health["adapters"] == {"alpha": rev_a}  # pinned: the revision it served, not the newer HEAD
        assert [(e["name"], e["revision"]) for e in health["adapters_not_restored"]] == [("beta", rev_b)]
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kiln-adapter-revision"] == rev_a
        assert httpx.post(f"{srv.base_url}/v1/adapters/alpha/unload", timeout=60).status_code == 200
    finally:
        stop_server(srv)
    assert json.loads(served.read_text())["adapters"] == {}  # the restore's outcome, then the unload, recorded


def _chat_revision(srv, model: str) -> str:
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.headers["x-kiln-adapter-revision"]


def test_default_adapter_serves_base_requests_pinned_and_survives_restart(builtin_model_dir, make_lora, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    kiln = Path(sys.executable).with_name("kiln")
    home = tmp_path / "home"
    args = ["--threads", "1", "--no-training"]
    srv = start_server(builtin_model_dir, home, extra_args=args, env_extra={}, config=None, log_dir=tmp_path)
    base = srv.model_id
    try:
        assert httpx.get(f"{srv.base_url}/v1/adapters/default").json() == {"default": None}
        assert _chat_revision(srv, base) == "base"
        rev = _upload(srv, "house", make_lora(seed=51, scale=0.2), tmp_path)
        out = subprocess.run([str(kiln), "adapters", "default", "house", "--url", srv.base_url],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and rev in out.stdout, out.stdout + out.stderr  # loaded it, pinned HEAD
        assert _chat_revision(srv, base) == rev  # requests naming the base get the default
        assert _chat_revision(srv, base + "@base") == "base"  # ... unless they ask for the bare base
        assert httpx.get(f"{srv.base_url}/health").json()["default_adapter"]["revision"] == rev
        newer = _upload(srv, "house", make_lora(seed=52, scale=0.2), tmp_path)
        assert httpx.post(f"{srv.base_url}/v1/adapters/house/load", timeout=60).status_code == 200
        d = httpx.get(f"{srv.base_url}/v1/adapters/default").json()["default"]
        assert d == {"name": "house", "revision": rev, "serving": False, "served_revision": newer}
        assert _chat_revision(srv, base) == "base"  # a swap never moves the default silently
        r = httpx.put(f"{srv.base_url}/v1/adapters/default", json={"name": "house"}, timeout=60)
        assert r.status_code == 200 and r.json()["default"]["revision"] == newer
        bad = httpx.put(f"{srv.base_url}/v1/adapters/default", json={"name": "nope"}, timeout=60)
        assert bad.status_code == 404
    finally:
        stop_server(srv)
    srv = start_server(builtin_model_dir, home, extra_args=args, env_extra={}, config=None, log_dir=tmp_path)
    try:
        assert _chat_revision(srv, base) == newer  # the default came back with its pinned revision
        assert httpx.delete(f"{srv.base_url}/v1/adapters/default").json() == {"default": None}
        assert _chat_revision(srv, base) == "base"
    finally:
        stop_server(srv)
    env = {"KILN_ADAPTERS_DEFAULT": f"house@{rev}"}  # the operator's start-up default, an older revision
    srv = start_server(builtin_model_dir, home, extra_args=args, env_extra=env, config=None, log_dir=tmp_path)
    try:
        assert _chat_revision(srv, base) == rev
    finally:
        stop_server(srv)


def test_a_damaged_served_set_is_ignored_and_reported_not_fatal(builtin_model_dir, tmp_path):
    """Item 2 of issue 45: a directory, or 200 KB of deeply nested JSON, in place of ``.served.json`` made
    ``kiln serve`` exit 3 with a traceback. Now start-up logs it, serves no restored adapters, and names the
    problem in ``/health`` (``served_set_error``); a valid set written later clears it on the next start."""
    home = tmp_path / "home"
    served = home / "adapters" / ".served.json"
    served.mkdir(parents=True)
    args = ["--threads", "1", "--no-training"]
    for damage in ("directory", "nested"):
        srv = start_server(builtin_model_dir, home, extra_args=args, env_extra={}, config=None, log_dir=tmp_path)
        try:
            health = httpx.get(f"{srv.base_url}/health").json()
            assert health["status"] == "ok" and health["adapters"] == {}
            problem = health["served_set_error"]
            assert problem and ".served.json" in problem, health
            assert ("regular file" if damage == "directory" else "invalid") in problem, problem
        finally:
            assert stop_server(srv) == 0
        log = srv.log_path.read_text(errors="replace")
        assert "Traceback" not in log and ".served.json" in log
        if damage == "directory":
            served.rmdir()
            served.write_bytes(b"[" * 100_000 + b"]" * 100_000)  # 200 KB, under the size limit, far too deep
    srv = start_server(builtin_model_dir, home, extra_args=args, env_extra={}, config=None, log_dir=tmp_path)
    try:  # the last start rewrote the file with the set it served: a valid (empty) one
        assert httpx.get(f"{srv.base_url}/health").json()["served_set_error"] is None
    finally:
        stop_server(srv)


def test_the_served_set_reader_refuses_every_damaged_file_without_raising(tmp_path):
    import os

    from kiln.adapters.served import ServedSet

    served = ServedSet(tmp_path)
    assert served.load() == ({}, None) and served.problem is None  # no file: nothing to report
    for damage in ("fifo", "garbage", "too_large", "wrong_schema"):
        if served.path.exists():
            served.path.unlink()
        if damage == "fifo":
            os.mkfifo(served.path)
        else:
            served.path.write_bytes({"garbage": b"\xff\x00{not json", "too_large": b" " * (300 << 10),
                                     "wrong_schema": b'{"schema": "other", "adapters": {}}'}[damage])
        assert served.load() == ({}, None)
        assert served.problem and ".served.json" in served.problem, damage
