"""/v1/adapters through the real app, served by uvicorn on 127.0.0.1 (ephemeral port), with a real engine."""

from __future__ import annotations

import io
import socket
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from kiln.adapters.archive import pack
from kiln.adapters.manifest import MANIFEST_FILE
from kiln.adapters.store import AdapterStore

from tests.adapters.conftest import lora_with_config

UPLOAD_LIMIT = 64 * 1024


def _make_app(loaded_settings, loaded_model):
    from kiln.serving.app import build_state, create_app

    state = build_state(loaded_settings, loaded_model)
    return create_app(loaded_settings, state=state), state


@pytest.fixture(scope="module")
def server(builtin_model_dir, tmp_path_factory):
    import uvicorn

    from kiln.config import load_settings
    from kiln.runtime.loader import load_model

    home = tmp_path_factory.mktemp("home")
    settings = load_settings(
        environ={
            "KILN_HOME": str(home),
            "KILN_MODEL_PATH": str(builtin_model_dir),
            "KILN_TRAINING_ENABLED": "false",
            "KILN_ADAPTERS_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT),
        },
        config_path=None,
    )
    app, state = _make_app(settings, load_model(builtin_model_dir, device="cpu"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


def _archive(src: Path, tmp_path: Path, folder: str = "x") -> bytes:
    out = tmp_path / f"{src.name}.tar.gz"
    pack(src, out, folder=folder)
    return out.read_bytes()


def _error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["code"] == code and body["message"] and "hint" in body
    return body


def test_upload_list_load_delete_lifecycle(client, server, make_lora, tmp_path):
    _url, state = server
    resp = client.post("/v1/adapters/life/upload", content=_archive(make_lora(seed=31, scale=0.2), tmp_path),
                       headers={"content-type": "application/gzip"})
    assert resp.status_code == 201, resp.text
    up = resp.json()
    assert up["name"] == "life" and up["kind"] == "upload" and up["active"] is False
    assert up["base_model_sha256"] == state.model.base_model_sha256

    listed = {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}
    entry = listed["life"]
    assert entry["revision"] == up["revision"] and entry["size_bytes"] > 0 and entry["created"].endswith("Z")

    resp = client.post("/v1/adapters/life/load")
    assert resp.status_code == 200, resp.text
    assert state.engine.active_adapters()["life"] == up["revision"]
    listed = {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}
    assert listed["life"]["active"] is True and listed["life"]["active_revision"] == up["revision"]

    _error(client.delete("/v1/adapters/life"), 409, "adapter_conflict")
    assert client.post("/v1/adapters/life/unload").status_code == 200
    assert "life" not in state.engine.active_adapters()
    _error(client.post("/v1/adapters/life/unload"), 404, "adapter_not_active")
    resp = client.delete("/v1/adapters/life")
    assert resp.status_code == 200 and resp.json()["revision"] == up["revision"]
    _error(client.get("/v1/adapters/life"), 404, "adapter_not_found")
    _error(client.post("/v1/adapters/life/load"), 404, "adapter_not_found")


def test_download_returns_the_stored_files_with_the_manifest(client, server, make_lora, tmp_path):
    src = make_lora(seed=32)
    up = client.post("/v1/adapters/dl/upload", content=_archive(src, tmp_path)).json()
    resp = client.get("/v1/adapters/dl/download")
    assert resp.status_code == 200
    assert resp.headers["x-kiln-adapter-revision"] == up["revision"]
    assert resp.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(resp.content), mode="r:gz") as tar:
        names = tar.getnames()
        assert names == ["dl/adapter_config.json", "dl/adapter_model.safetensors", f"dl/{MANIFEST_FILE}"]
        weights = tar.extractfile("dl/adapter_model.safetensors").read()
    assert weights == (src / "adapter_model.safetensors").read_bytes()
    # the download is reproducible and uploads back to the same content
    assert client.get("/v1/adapters/dl/download").content == resp.content
    again = client.post("/v1/adapters/dl/upload", content=resp.content).json()
    assert again["revision"] == up["revision"]
    store = AdapterStore(server[1].settings.adapters_path)
    assert list((store.root / ".staging").iterdir()) == []


def test_hostile_and_oversize_uploads_are_refused(client, server, make_lora, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        link = tarfile.TarInfo("adapter_config.json")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    _error(client.post("/v1/adapters/evil/upload", content=buf.getvalue()), 400, "unsafe_archive")
    _error(client.post("/v1/adapters/evil/upload", content=b"\0" * (UPLOAD_LIMIT + 1)), 413, "adapter_too_large")

    def chunks():  # no Content-Length: the cap applies while streaming
        for _ in range(UPLOAD_LIMIT // 4096 + 2):
            yield b"\0" * 4096

    _error(client.post("/v1/adapters/evil/upload", content=chunks()), 413, "adapter_too_large")
    _error(client.post("/v1/adapters/.evil/upload", content=b"x"), 400, "invalid_adapter")
    nan_lora = make_lora(seed=33)
    data = bytearray((nan_lora / "adapter_model.safetensors").read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len: 8 + header_len + 4] = b"\x00\x00\xc0\x7f"  # NaN
    (nan_lora / "adapter_model.safetensors").write_bytes(bytes(data))
    body = _error(client.post("/v1/adapters/evil/upload", content=_archive(nan_lora, tmp_path)), 400, "invalid_adapter")
    assert "non-finite" in body["message"]
    names = [a["name"] for a in client.get("/v1/adapters").json()["data"]]
    assert "evil" not in names
    assert list((AdapterStore(server[1].settings.adapters_path).root / ".staging").iterdir()) == []


def test_merge_over_http(client, make_lora, tmp_path):
    a = client.post("/v1/adapters/ma/upload", content=_archive(make_lora(seed=34), tmp_path, "a")).json()
    b = client.post("/v1/adapters/mb/upload", content=_archive(make_lora(seed=35, r=2), tmp_path, "b")).json()
    resp = client.post("/v1/adapters/merge", json={
        "name": "mab", "method": "cat", "adapters": [{"name": "ma", "weight": 1.0}, {"name": "mb", "weight": 0.5}],
    })
    assert resp.status_code == 201, resp.text
    merged = client.get("/v1/adapters/mab").json()
    assert merged["kind"] == "merge"
    assert [p["revision"] for p in merged["manifest"]["config"]["parents"]] == [a["revision"], b["revision"]]
    assert client.post("/v1/adapters/mab/load").status_code == 200
    assert client.post("/v1/adapters/mab/unload").status_code == 200
    _error(client.post("/v1/adapters/merge", json={
        "name": "bad", "method": "linear", "adapters": [{"name": "ma"}, {"name": "mb"}],
    }), 400, "invalid_adapter")
    _error(client.post("/v1/adapters/merge", json={"name": "bad", "adapters": [{"name": "nope"}]}),
           404, "adapter_not_found")
    assert client.post("/v1/adapters/merge", json={"name": "bad", "adapters": []}).status_code == 400


def _kiln(*args: str) -> "subprocess.CompletedProcess[str]":
    import subprocess
    import sys

    kiln = Path(sys.executable).parent / "kiln"
    return subprocess.run([str(kiln), "adapters", *args], capture_output=True, text=True, timeout=60)


def test_cli_against_the_server(client, server, make_lora, tmp_path):
    url, state = server
    up = client.post("/v1/adapters/clitest/upload", content=_archive(make_lora(seed=36), tmp_path)).json()
    out = _kiln("list", "--url", url)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "clitest" in line)
    assert up["revision"][:12] in row and "upload" in row

    out = _kiln("load", "clitest", "--url", url)
    assert out.returncode == 0, out.stderr
    assert state.engine.active_adapters()["clitest"] == up["revision"]
    row = next(line for line in _kiln("list", "--url", url).stdout.splitlines() if "clitest" in line)
    assert "yes" in row

    out = _kiln("delete", "clitest", "--url", url)
    assert out.returncode == 1 and "409" in out.stderr and "unload" in out.stderr
    assert _kiln("unload", "clitest", "--url", url).returncode == 0
    out = _kiln("delete", "clitest", "--url", url)
    assert out.returncode == 0 and up["revision"] in out.stdout
    out = _kiln("load", "clitest", "--url", url)
    assert out.returncode == 1 and "404" in out.stderr


def test_uploaded_patterns_are_bounded_and_invalid_ones_are_400(client, server, make_lora, tmp_path):
    src = make_lora(seed=60)
    started = time.monotonic()
    body = _error(client.post("/v1/adapters/rx/upload", content=_archive(
        lora_with_config(src, tmp_path, target_modules="([a-z_.0-9]+)+X"), tmp_path)), 400, "invalid_adapter")
    assert "not covered" in body["message"] and time.monotonic() - started < 5
    body = _error(client.post("/v1/adapters/rx/upload", content=_archive(
        lora_with_config(src, tmp_path, target_modules="("), tmp_path)), 400, "invalid_adapter")
    assert "not a valid pattern" in body["message"] and body["param"] == "target_modules"
    ok = client.post("/v1/adapters/rx/upload", content=_archive(
        lora_with_config(src, tmp_path, target_modules=r".*\.(q_proj|v_proj)",
                   base_model_name_or_path="/home/someone/.kiln/models/x"), tmp_path))
    assert ok.status_code == 201, ok.text
    with tarfile.open(fileobj=io.BytesIO(client.get("/v1/adapters/rx/download").content), mode="r:gz") as tar:
        cfg = tar.extractfile("rx/adapter_config.json").read().decode()
    assert "/home/someone" not in cfg and '"target_modules": [' in cfg


def test_amplifying_upload_is_refused_without_writing(client, server, tmp_path):
    raw = io.BytesIO()
    info = tarfile.TarInfo("README.md")
    info.size = 1 << 30  # declared 1 GiB of zeros; refused from the header
    raw.write(info.tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * (1 << 20))
    import gzip

    body = _error(client.post("/v1/adapters/amp/upload", content=gzip.compress(raw.getvalue())), 413,
                  "adapter_too_large")
    assert "README.md" in body["message"]
    assert list((AdapterStore(server[1].settings.adapters_path).root / ".staging").iterdir()) == []


def test_concurrent_uploads_are_limited(client, server, make_lora, tmp_path):
    from kiln.serving.routes_adapters import MAX_CONCURRENT_UPLOADS

    url, state = server
    release = threading.Event()

    def slow_body():
        yield b"\x1f\x8b"
        release.wait(30)

    def hold(name: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            c.post(f"/v1/adapters/{name}/upload", content=slow_body())

    holders = [threading.Thread(target=hold, args=(f"slow{i}",)) for i in range(MAX_CONCURRENT_UPLOADS)]
    try:
        holders[0].start()
        deadline = time.monotonic() + 10
        while "slow0" not in (state.extras.get("adapter_upload_gate") and state.extras["adapter_upload_gate"].active()
                              or set()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        body = _error(client.post("/v1/adapters/slow0/upload", content=b"x"), 409, "adapter_conflict")
        assert "already in progress" in body["message"]
        for t in holders[1:]:
            t.start()
        while len(state.extras["adapter_upload_gate"].active()) < MAX_CONCURRENT_UPLOADS:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        resp = client.post("/v1/adapters/other/upload", content=b"x")
        _error(resp, 429, "adapter_uploads_busy")
        assert int(resp.headers["retry-after"]) >= 1
    finally:
        release.set()
        for t in holders:
            t.join(30)
    assert state.extras["adapter_upload_gate"].active() == set()
    up = client.post("/v1/adapters/slow0/upload", content=_archive(make_lora(seed=61), tmp_path))
    assert up.status_code == 201, up.text


def test_a_failed_canary_quarantines_the_revision_until_cleared(client, server, make_lora, tmp_path):
    """Finite weights so large the forward overflows: the canary fails, the load is refused (400), the
    revision is marked (reason, time) and refused (409) until an operator clears it; nothing is served."""
    _url, state = server
    resp = client.post("/v1/adapters/hot/upload", content=_archive(make_lora(seed=61, scale=1e18), tmp_path),
                       headers={"content-type": "application/gzip"})
    assert resp.status_code == 201, resp.text
    rev = resp.json()["revision"]
    _error(client.post("/v1/adapters/hot/load"), 400, "adapter_rejected")
    assert "hot" not in state.engine.active_adapters()
    marks = client.get("/v1/adapters/hot").json()["quarantined"]
    assert list(marks) == [rev] and "canary" in marks[rev]["reason"] and marks[rev]["at"].endswith("Z")
    body = _error(client.post("/v1/adapters/hot/load"), 409, "adapter_quarantined")
    assert "quarantine/clear" in body["hint"]
    _error(client.put("/v1/adapters/default", json={"name": "hot"}), 409, "adapter_quarantined")
    listed = {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}
    assert list(listed["hot"]["quarantined"]) == [rev]
    assert client.post("/v1/adapters/hot/quarantine/clear").json() == {"name": "hot", "cleared": [rev]}
    _error(client.post("/v1/adapters/hot/load"), 400, "adapter_rejected")  # tried again (and marked again)
    assert list(client.get("/v1/adapters/hot").json()["quarantined"]) == [rev]
    assert client.post("/v1/adapters/hot/quarantine/clear").status_code == 200
    assert client.delete("/v1/adapters/hot").status_code == 200


def _publish_trained(state, base_info, src, name: str, job_id: str):
    """Publish ``src`` into the running server's store as a training job does (kind sft, with a receipt)."""
    from kiln.adapters.receipt import training_claims

    from tests.adapters.conftest import stage_copy

    claims = training_claims(job_id=job_id, plan_sha256="c" * 64,
                             inputs={"inputs_sha256": "b" * 64, "dataset_sha256": "d" * 64}, teacher=None)
    return state.store.publish(stage_copy(state.store, src), name=name, base_model_sha256=base_info.base_model_sha256,
                               kind="sft", config={"epochs": 1, "job_id": job_id}, inputs_sha256="b" * 64,
                               parent_revision=None, base_model_dir=base_info, receipt=claims)


def _cli_verify(state, target: str):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kiln.cli", "adapters", "verify", target], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "KILN_HOME": str(state.store.root.parent)})


def test_a_fifo_in_place_of_a_receipt_never_blocks_the_server(client, server, make_lora, base_info):
    """Item 1 of issue 45: a FIFO where kiln-receipt.json belongs used to block every reader forever (the list,
    the receipt route, `kiln adapters verify`) until the server's threads ran out. Now each answers at once,
    the adapter is marked unverified with the reason, and the server keeps answering everything else."""
    import os

    _url, state = server
    fifo = _publish_trained(state, base_info, make_lora(seed=71), "fifo-receipt", "job-0000000000000071")
    good = _publish_trained(state, base_info, make_lora(seed=72), "good-receipt", "job-0000000000000072")
    receipt = fifo.path / "kiln-receipt.json"
    receipt.unlink()
    os.mkfifo(receipt, 0o600)
    try:
        for _ in range(45):  # more requests than the server has threads: none may be left stuck
            listed = {a["name"]: a for a in client.get("/v1/adapters").json()["data"]}
        bad = listed["fifo-receipt"]
        assert bad["verified"] is False and "not a regular file" in bad["error"], bad
        assert bad["receipt"]["verified"] is False and bad["revision"] == fifo.revision
        assert listed["good-receipt"]["verified"] is True and listed["good-receipt"]["error"] is None
        one = client.get("/v1/adapters/fifo-receipt")
        assert one.status_code == 200 and one.json()["verified"] is False and one.json()["manifest"]
        body = _error(client.get("/v1/adapters/fifo-receipt/receipt"), 500, "adapter_integrity")
        assert "kiln-receipt.json is not a regular file" in body["message"]
        assert client.get(f"/v1/adapters/good-receipt/receipt?revision={good.revision}").status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/v1/models").status_code == 200
        cli = _cli_verify(state, "fifo-receipt")
        assert cli.returncode == 1 and "not a regular file" in cli.stderr, cli.stdout + cli.stderr
        assert "Traceback" not in cli.stderr
    finally:
        try:  # a reader the old code left blocked in open() is freed by a writer
            os.close(os.open(receipt, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert client.delete("/v1/adapters/fifo-receipt").status_code == 200
    assert client.delete("/v1/adapters/good-receipt").status_code == 200


def test_one_damaged_adapter_is_marked_and_the_rest_are_listed(client, server, make_lora, base_info):
    """Item 5 of issue 45: a receipt that is a directory turned GET /v1/adapters into a 500 and dropped
    GET /v1/adapters/{name}; a damaged manifest hid every adapter. Now each damaged one is listed with
    ``verified: false`` and the reason, the others as before, the CLI says why and exits 1, and the damaged
    adapter can still be deleted."""
    _url, state = server
    dir_receipt = _publish_trained(state, base_info, make_lora(seed=81), "dir-receipt", "job-0000000000000081")
    torn = _publish_trained(state, base_info, make_lora(seed=82), "torn-manifest", "job-0000000000000082")
    fine = _publish_trained(state, base_info, make_lora(seed=83), "fine-one", "job-0000000000000083")
    receipt = dir_receipt.path / "kiln-receipt.json"
    receipt.unlink()
    receipt.mkdir()
    (torn.path / MANIFEST_FILE).write_bytes(b'{"schema": "kiln.adapter-manifest.v1", "name": ')
    resp = client.get("/v1/adapters")
    assert resp.status_code == 200, resp.text
    listed = {a["name"]: a for a in resp.json()["data"]}
    assert listed["dir-receipt"]["verified"] is False and "not a regular file" in listed["dir-receipt"]["error"]
    assert listed["dir-receipt"]["revision"] == dir_receipt.revision
    assert listed["torn-manifest"]["verified"] is False and listed["torn-manifest"]["revision"] is None
    assert "not valid JSON" in listed["torn-manifest"]["error"], listed["torn-manifest"]
    assert listed["fine-one"]["verified"] is True and listed["fine-one"]["revision"] == fine.revision
    one = client.get("/v1/adapters/torn-manifest")
    assert one.status_code == 200 and one.json()["verified"] is False and one.json()["manifest"] is None
    one = client.get("/v1/adapters/dir-receipt")
    assert one.status_code == 200 and one.json()["verified"] is False and one.json()["manifest"]["name"] == "dir-receipt"
    _error(client.get("/v1/adapters/dir-receipt/receipt"), 500, "adapter_integrity")
    _error(client.post("/v1/adapters/torn-manifest/load"), 500, "adapter_integrity")
    for name, why in (("dir-receipt", "not a regular file"), ("torn-manifest", "not valid JSON")):
        cli = _cli_verify(state, name)
        assert cli.returncode == 1 and why in cli.stderr and "verify failed" in cli.stderr, cli.stderr
        assert "Traceback" not in cli.stderr
    for name in ("dir-receipt", "torn-manifest", "fine-one"):
        assert client.delete(f"/v1/adapters/{name}").status_code == 200, name
    assert not {"dir-receipt", "torn-manifest", "fine-one"} & {a["name"] for a in client.get("/v1/adapters").json()["data"]}
