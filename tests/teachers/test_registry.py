"""The teacher registry against real servers on 127.0.0.1.

Two ``kiln serve`` subprocesses: ``teacher`` (a plain Kiln server; its scoring
answers carry a kiln-teacher-v1 fingerprint) and ``student`` (started with a
``[teachers.credentials.*]`` entry whose secret must never appear anywhere, and
with a legacy registry file that must be migrated). A small stdlib HTTP server
on loopback plays a misbehaving teacher for the refusal tests.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kiln.teachers.identity import TeacherIdentityV1
from kiln.teachers.kiln_identity import identity_from_fingerprint
from tests.serving.conftest import start_server, stop_server

SECRET = "s3cr3t-teacher-key-Zq81"
SECRET_ENV = "KILN_TEST_TEACHER_SECRET"
CONFIG = f"""
[teachers.credentials.primary-vllm]
origin = "https://teacher.example.com:8443"
api_key_env = "{SECRET_ENV}"
"""
LEGACY = {"schema": "kiln.teacher-registry.v1", "teachers": {"old@vllm": {
    "alias": "old@vllm", "kind": "remote", "provider": "vllm", "model_id": "old", "url": "http://127.0.0.1:9",
    "api_key_env": SECRET_ENV, "status": "ready", "usable": True, "fingerprint": None, "identity": None}}}


@pytest.fixture(scope="module")
def pair(builtin_model_dir, tmp_path_factory):
    t_home = tmp_path_factory.mktemp("teacher-home")
    s_home = tmp_path_factory.mktemp("student-home")
    (s_home / "teachers").mkdir(mode=0o700)
    (s_home / "teachers" / "registry.json").write_text(json.dumps(LEGACY))
    config = s_home / "kiln.toml"
    config.write_text(CONFIG)
    teacher = start_server(builtin_model_dir, t_home, extra_args=["--no-training"], env_extra={}, config=None)
    try:
        student = start_server(builtin_model_dir, s_home, extra_args=["--no-training"],
                               env_extra={SECRET_ENV: SECRET}, config=config)
    except BaseException:
        stop_server(teacher)
        raise
    yield teacher, student, s_home
    stop_server(student)
    stop_server(teacher)


def _score(base: str, model: str, k: int) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                                                   "prompt_logprobs": k}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _err(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if code is not None:
        assert err["code"] == code, err
    return err


def test_kiln_scoring_answers_carry_kiln_teacher_fingerprint(pair):
    teacher, _, _ = pair
    body = _score(teacher.base_url, teacher.model_id, 3)
    ident = identity_from_fingerprint(body["system_fingerprint"])
    assert ident.implementation.startswith("kiln:") and ident.served_model_id == teacher.model_id
    assert ident.adapter is None and ident.max_top_k >= 3
    # Stable across requests (same runtime, same model).
    assert _score(teacher.base_url, teacher.model_id, 1)["system_fingerprint"] == body["system_fingerprint"]


def test_register_remote_kiln_teacher_passes_both_probes(pair):
    teacher, student, home = pair
    c = httpx.Client(base_url=student.base_url, timeout=120)
    r = c.post("/v1/teachers", json={"alias": "big@kiln", "kind": "remote", "provider": "kiln",
                                     "model_id": teacher.model_id, "url": teacher.base_url})
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["status"] == "ready" and t["usable"] is True
    assert t["fingerprint"].startswith("kiln-teacher-v1.")
    assert t["probes"]["max_k"] == t["bounds"]["max_top_k"] and t["probes"]["top1_candidates"] > 0
    assert t["off_policy_manifest"]["teacher_fingerprint"] == t["fingerprint"]
    assert t["off_policy_manifest"]["identity"] == t["identity"]
    assert len(t["identity_revision"]) == 64
    assert c.get("/v1/teachers/big@kiln").json()["fingerprint"] == t["fingerprint"]
    assert "big@kiln" in [x["alias"] for x in c.get("/v1/teachers").json()["data"]]
    # Immutable alias.
    _err(c.post("/v1/teachers", json={"alias": "big@kiln", "kind": "local"}), 409, "teacher_alias_exists")
    reg = home / "teachers" / "registry.json"
    assert stat.S_IMODE(reg.stat().st_mode) == 0o600
    assert "big@kiln" in json.loads(reg.read_text())["teachers"]
    # Delete, then gone.
    assert c.delete("/v1/teachers/big@kiln").status_code == 200
    _err(c.get("/v1/teachers/big@kiln"), 404, "teacher_not_found")


def test_register_local_teacher(pair):
    _, student, _ = pair
    c = httpx.Client(base_url=student.base_url, timeout=120)
    r = c.post("/v1/teachers", json={"alias": "self", "kind": "local"})
    assert r.status_code == 201, r.text
    assert r.json()["model_id"] == student.model_id and r.json()["usable"]
    _err(c.post("/v1/teachers", json={"alias": "self-ad", "kind": "local", "adapter": "nope"}), 404)


@pytest.mark.parametrize("field", ["identity", "tokenizer_vocab_sha256", "vocab_size", "top_k", "full_vocab",
                                   "api_key_env"])
def test_registration_cannot_supply_proved_or_secret_fields(pair, field):
    teacher, student, _ = pair
    body = {"alias": "x", "kind": "remote", "provider": "kiln", "model_id": teacher.model_id,
            "url": teacher.base_url, field: 1}
    err = _err(httpx.post(f"{student.base_url}/v1/teachers", json=body, timeout=30), 400)
    assert field in err["message"]


def test_url_rules(pair):
    _, student, _ = pair
    post = lambda body: httpx.post(f"{student.base_url}/v1/teachers", json=body, timeout=30)  # noqa: E731
    base = {"alias": "u", "kind": "remote", "provider": "vllm", "model_id": "m"}
    _err(post(base | {"url": "http://10.1.2.3:8000"}), 400, "teacher_url_not_loopback")
    _err(post(base | {"url": "http://127.0.0.1:8000/v1"}), 400, "teacher_url_not_loopback")
    _err(post(base | {"url": "https://teacher.example.com:8443"}), 400, "teacher_url_not_loopback")
    _err(post(base | {"url": "https://teacher.example.com", "credential_id": "primary-vllm"}), 400,
         "teacher_url_origin_mismatch")
    # a credential the configuration does not have: 404 (a resource this server lacks), with the typed envelope
    unknown = _err(post(base | {"url": "https://teacher.example.com:8443", "credential_id": "nope"}), 404,
                   "unknown_credential")
    assert unknown["type"] == "not_found_error" and unknown["param"] == "credential_id"
    assert "[teachers.credentials.<id>]" in unknown["hint"]
    # an id no configuration can hold (kiln.toml's rule, published in /openapi.json): the caller's mistake
    _err(post(base | {"url": "https://teacher.example.com:8443", "credential_id": ""}), 400, "invalid_request")


# ----------------------------------------------------------------- a misbehaving teacher


class _Fake:
    def __init__(self, identity: TeacherIdentityV1):
        self.identity = identity
        self.mode = "ok"
        self.fingerprint = identity.fingerprint()

    def answer(self, req: dict) -> tuple[int, dict[str, str], bytes]:
        k = req["prompt_logprobs"]
        rows = [None] + [{str(i): {"logprob": -1.0 - i, "rank": i + 1, "decoded_token": "x"} for i in range(k)}
                         for _ in req["prompt"][1:]]
        body = {"id": "c", "object": "text_completion", "created": 0, "model": req["model"],
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": rows}]}
        if self.mode == "redirect":
            return 307, {"Location": "http://127.0.0.1:1/v1/completions"}, b""
        if self.mode.startswith("huge"):
            body["padding"] = "x" * (8 * 1024 * 1024)
        if self.mode == "wrong_model":
            body["model"] = "someone-else"
        return 200, {}, json.dumps(body).encode()


def _fake_server(fake: _Fake):
    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, headers, data = fake.answer(req)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            if fake.mode != "huge_chunked":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except OSError:
                pass

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def fake(pair):
    teacher, _, _ = pair
    real = identity_from_fingerprint(_score(teacher.base_url, teacher.model_id, 1)["system_fingerprint"])
    fields = {k: getattr(real, k) for k in ("base_model_sha256", "tokenizer_vocab_sha256", "tokenizer_config_sha256",
                                            "adapter", "vocab_size", "max_top_k", "max_model_len",
                                            "max_prompt_logprob_candidates", "inference_config_sha256")}
    ident = TeacherIdentityV1(served_model_id="fake-teacher", implementation="vllm:0.32.0", **fields)
    f = _Fake(ident)
    srv = _fake_server(f)
    f.url = f"http://127.0.0.1:{srv.server_address[1]}"
    f.fields = fields
    yield f
    srv.shutdown()


def _register_fake(student, fake, alias="fake"):
    return httpx.post(f"{student.base_url}/v1/teachers", timeout=60, json={
        "alias": alias, "kind": "remote", "provider": "vllm", "model_id": "fake-teacher", "url": fake.url})


def test_fake_teacher_with_valid_identity_registers(pair, fake):
    _, student, _ = pair
    fake.mode = "ok"
    r = _register_fake(student, fake, "fake-ok")
    assert r.status_code == 201, r.text
    httpx.delete(f"{student.base_url}/v1/teachers/fake-ok")


def test_stock_vllm_fingerprint_refused(pair, fake):
    _, student, _ = pair
    fake.mode, fake.fingerprint = "ok", "vllm-0.32.0-abcdef"
    try:
        err = _err(_register_fake(student, fake), 409, "teacher_fingerprint_invalid")
        assert "kiln-teacher-v1" in err["message"]
    finally:
        fake.fingerprint = fake.identity.fingerprint()


def test_deeply_nested_fingerprint_is_a_4xx_not_a_500(pair, fake):
    """Issue 44 item 8 (teacher-launcher.txt: only "the canonical kiln-teacher-v1 fingerprint" is
    accepted): a fingerprint whose payload nests 40,000 deep (deep enough for the parser's recursion limit,
    small enough that the answer fits the identity's size ceiling) is teacher_fingerprint_invalid over HTTP."""
    import base64
    import hashlib

    _, student, _ = pair
    payload = b"[" * 40_000 + b"]" * 40_000
    b64 = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    fake.mode, fake.fingerprint = "ok", f"kiln-teacher-v1.{b64}.{hashlib.sha256(payload).hexdigest()}"
    try:
        _err(_register_fake(student, fake, "fake-deep"), 409, "teacher_fingerprint_invalid")
    finally:
        fake.fingerprint = fake.identity.fingerprint()


def test_response_model_mismatch_refused(pair, fake):
    _, student, _ = pair
    fake.mode = "wrong_model"
    _err(_register_fake(student, fake), 409, "teacher_model_mismatch")


def test_identity_for_another_model_id_refused(pair, fake):
    _, student, _ = pair
    fake.mode = "ok"
    r = httpx.post(f"{student.base_url}/v1/teachers", timeout=60, json={
        "alias": "fake", "kind": "remote", "provider": "vllm", "model_id": "other-id", "url": fake.url})
    _err(r, 409, "teacher_model_mismatch")


@pytest.mark.parametrize("change,code", [({"vocab_size": None}, "teacher_vocab_mismatch"),
                                         ({"tokenizer_vocab_sha256": "0" * 64}, "teacher_tokenizer_mismatch")])
def test_vocabulary_mismatch_refused_naming_it(pair, fake, change, code):
    _, student, _ = pair
    fields = dict(fake.fields)
    for k, v in change.items():
        fields[k] = v if v is not None else fields["vocab_size"] + 64
    fields["max_prompt_logprob_candidates"] = fields["max_top_k"] + 1
    fake.mode = "ok"
    fake.fingerprint = TeacherIdentityV1(served_model_id="fake-teacher", implementation="vllm:0.32.0",
                                         **fields).fingerprint()
    try:
        err = _err(_register_fake(student, fake), 409, code)
        assert ("vocabulary width" in err["message"]) or ("token IDs" in err["message"])
    finally:
        fake.fingerprint = fake.identity.fingerprint()


@pytest.mark.parametrize("mode", ["huge", "huge_chunked"])
def test_oversized_answer_refused_before_reading(pair, fake, mode):
    _, student, _ = pair
    fake.mode = mode
    _err(_register_fake(student, fake), 413, "teacher_response_too_large")


def test_redirects_disabled(pair, fake):
    _, student, _ = pair
    fake.mode = "redirect"
    err = _err(_register_fake(student, fake), 409)
    assert "redirect" in err["message"]


# ----------------------------------------------------------------- secrets and legacy entries


def test_legacy_api_key_env_stripped_and_unusable(pair):
    _, student, home = pair
    stored = json.loads((home / "teachers" / "registry.json").read_text())["teachers"]["old@vllm"]
    assert "api_key_env" not in stored and stored["usable"] is False
    t = httpx.get(f"{student.base_url}/v1/teachers/old@vllm").json()
    assert t["usable"] is False and t["status"] == "needs_reregistration"


def test_secret_never_appears(pair):
    _, student, home = pair
    c = httpx.Client(base_url=student.base_url, timeout=60)
    seen = []
    # A credentialed registration: the origin does not resolve, so the request fails after reading the key.
    seen.append(c.post("/v1/teachers", json={"alias": "remote@vllm", "kind": "remote", "provider": "vllm",
                                             "model_id": "m", "url": "https://teacher.example.com:8443",
                                             "credential_id": "primary-vllm"}))
    seen += [c.get("/v1/teachers"), c.get("/v1/teachers/old@vllm"), c.get("/v1/config"), c.get("/openapi.json")]
    for r in seen:
        assert SECRET not in r.text
    assert seen[0].status_code in (409, 503), seen[0].text
    assert SECRET_ENV in c.get("/v1/config").text  # the variable's NAME is fine to show
    for path in (home / "teachers").rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace")
    assert SECRET not in student.log()
    encoded = base64.b64encode(SECRET.encode()).decode()
    assert encoded not in student.log()


def test_missing_credential_secret_fails_at_startup(tmp_path):
    from kiln.config import ConfigError, load_settings

    cfg = tmp_path / "kiln.toml"
    cfg.write_text(CONFIG)
    with pytest.raises(ConfigError, match=SECRET_ENV):
        load_settings(config_path=cfg, environ={})
    with pytest.raises(ConfigError, match="whitespace"):
        load_settings(config_path=cfg, environ={SECRET_ENV: "  "})
    assert load_settings(config_path=cfg, environ={SECRET_ENV: "x"}).settings.teachers.credentials
    cfg.write_text(CONFIG.replace(":8443", ":443"))
    with pytest.raises(ConfigError):
        load_settings(config_path=cfg, environ={SECRET_ENV: "x"})
    cfg.write_text(CONFIG.replace("https://teacher.example.com:8443", "http://teacher.example.com"))
    with pytest.raises(ConfigError):
        load_settings(config_path=cfg, environ={SECRET_ENV: "x"})
    os.environ.pop(SECRET_ENV, None)


def test_cli_add_list_show_remove(pair):
    import subprocess

    from tests.serving.conftest import KILN

    teacher, student, _ = pair
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}

    def kiln(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(KILN), "teachers", *args, "--url", student.base_url], env=env,
                              capture_output=True, text=True, timeout=120)

    r = kiln("add", "cli@kiln", "--provider", "kiln", "--model-id", teacher.model_id, "--teacher-url", teacher.base_url)
    assert r.returncode == 0 and "registered cli@kiln" in r.stdout, r.stderr
    assert "cli@kiln" in kiln("list").stdout
    assert json.loads(kiln("show", "cli@kiln").stdout)["usable"] is True
    assert kiln("remove", "cli@kiln").returncode == 0
    r = kiln("show", "cli@kiln")
    assert r.returncode == 1 and "teacher_not_found" in r.stderr
