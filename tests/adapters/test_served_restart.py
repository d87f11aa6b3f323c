"""The served adapter set survives a restart of ``kiln serve``, each adapter at the revision it served.

Before, active adapters came back inactive and clients that named them got 404 until someone
reloaded them. Real ``kiln serve`` subprocesses over one ``$KILN_HOME``, real uploads.
"""

from __future__ import annotations

import json
import stat

import httpx

from kiln.adapters.archive import pack
from tests.serving.conftest import start_server, stop_server


def _upload(srv, name: str, src, tmp_path) -> str:
    out = tmp_path / f"{name}-{src.name}.tar.gz"
    pack(src, out, folder=name)
    r = httpx.post(f"{srv.base_url}/v1/adapters/{name}/upload", content=out.read_bytes(), timeout=60,
                   headers={"content-type": "application/gzip"})
    assert r.status_code == 201, r.text
    return r.json()["revision"]


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
