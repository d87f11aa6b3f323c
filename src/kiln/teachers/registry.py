"""The teacher registry: aliases -> probed, identity-pinned teacher specs.

Persisted as one JSON file (default ``$KILN_HOME/teachers/registry.json``,
mode 0600) through :func:`kiln.canonical.atomic_write_json`. An alias is
published only after both probes pass and is immutable (delete and register
again to change it). The file never holds a secret: remote teachers name a
``credential_id`` from kiln.toml. Legacy entries with ``api_key_env`` are
migrated at load: the field is removed without being trusted, the entry is
marked unusable, and the file is atomically rewritten.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.canonical import atomic_write_json, sha256_hex
from kiln.errors import Conflict, InvalidRequest, NotFound
from kiln.system.credentials import CREDENTIAL_ID_PATTERN, CredentialHandle, resolve_credential
from kiln.teachers.identity import IDENTITY_SCHEMA, PROTOCOL, TeacherIdentityV1
from kiln.teachers.probe import LocalTeacher, ProbeReport, RemoteTeacher, StudentFacts, probe
from kiln.wire_rules import NOT_NULL, field_is, rules, when

log = logging.getLogger("kiln.teachers")

REGISTRY_SCHEMA = "kiln.teacher-registry.v1"
OFF_POLICY_SCHEMA = "kiln.opd-off-policy-manifest.v1"
ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")
MAX_URL_CHARS = 2048
MAX_TEACHERS = 1024
REGISTRY_MODE = 0o600
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
# Fields a registration may never carry: the probes prove them, or kiln.toml owns them.
FORBIDDEN_FIELDS = {
    "identity": "the identity is read from the teacher's fingerprint by the probes",
    "fingerprint": "the fingerprint is read from the teacher's answers by the probes",
    "tokenizer_vocab_sha256": "the tokenizer hash is part of the probed identity",
    "tokenizer_config_sha256": "the tokenizer hash is part of the probed identity",
    "tokenizer_hash": "the tokenizer hash is part of the probed identity",
    "vocab_size": "the vocabulary size is part of the probed identity",
    "top_k": "top-K is the probed identity's max_top_k",
    "max_top_k": "top-K is the probed identity's max_top_k",
    "full_vocab": "full-vocabulary support follows from the probed identity",
    "supports_full_vocab": "full-vocabulary support follows from the probed identity",
    "api_key_env": "secrets are configured only in kiln.toml [teachers.credentials.<id>]; pass credential_id",
    "api_key": "secrets are configured only in kiln.toml [teachers.credentials.<id>]; pass credential_id",
}


LOOPBACK_URL_PATTERN = r"^http://(localhost|127\.0\.0\.1|\[::1\]):[1-9][0-9]{0,3}$"


class TeacherRequest(BaseModel):
    """``POST /v1/teachers``."""

    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra=rules(
        when(field_is("kind", {"const": "remote"}),
             {"allOf": [field_is(name, NOT_NULL) for name in ("provider", "model_id", "url")]
              + [{"properties": {"adapter": {"type": "null"}}}]}),
        # without a credential only an exact loopback URL is accepted (check_url)
        when({"allOf": [field_is("kind", {"const": "remote"}),
                        {"not": field_is("credential_id", NOT_NULL)}]},
             field_is("url", {"pattern": LOOPBACK_URL_PATTERN})),
        when(field_is("kind", {"const": "local"}),
             {"properties": {name: {"type": "null"} for name in ("provider", "url", "credential_id", "model_id")}})))

    alias: str = Field(min_length=1, max_length=128, pattern=ALIAS_RE.pattern)
    kind: Literal["remote", "local"]
    provider: Literal["vllm", "kiln"] | None = Field(None, description="remote teachers: vllm or kiln")
    model_id: str | None = Field(None, min_length=1, max_length=128,
                                 description="remote: the teacher's served model ID")
    url: str | None = Field(None, max_length=MAX_URL_CHARS, description="remote: exact base URL")
    credential_id: str | None = Field(None, max_length=64, pattern=CREDENTIAL_ID_PATTERN,
                                      description="a [teachers.credentials.<id>] entry (404 when none has this id)")
    adapter: str | None = Field(None, max_length=64, description="local: a loaded adapter to teach with")

    @model_validator(mode="before")
    @classmethod
    def _forbidden(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key in FORBIDDEN_FIELDS:
                    raise ValueError(f"registration cannot supply {key!r}: {FORBIDDEN_FIELDS[key]}")
        return data

    @model_validator(mode="after")
    def _shape(self) -> "TeacherRequest":
        if self.kind == "remote":
            if self.provider is None or self.model_id is None or self.url is None:
                raise ValueError("a remote teacher needs provider, model_id and url")
            if self.adapter is not None:
                raise ValueError("adapter is for local teachers; a remote teacher serves its adapter as model_id")
        else:
            for name in ("provider", "url", "credential_id", "model_id"):
                if getattr(self, name) is not None:
                    raise ValueError(f"a local teacher takes no {name} (it is this server's model, "
                                     "optionally with `adapter`)")
        return self


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, *, credential: CredentialHandle | None, server_host: str) -> str:
    """The URL rules: credential-free only on an exact loopback URL with Kiln on loopback; else the
    credential's exact canonical HTTPS origin."""
    parts = urlsplit(url)
    bare = (not parts.path or parts.path == "") and not parts.query and not parts.fragment and not parts.username \
        and not parts.password
    if credential is None:
        host = parts.hostname or ""
        if parts.scheme != "http" or not bare or not _is_loopback_host(host) or parts.port is None \
                or url != f"http://{parts.netloc}":
            raise InvalidRequest(
                f"url {url!r}: a credential-free teacher must use an exact loopback URL like http://127.0.0.1:8000",
                code="teacher_url_not_loopback", param="url",
                hint="for an off-host teacher configure [teachers.credentials.<id>] and pass credential_id")
        if not _is_loopback_host(server_host):
            raise InvalidRequest(
                f"this server listens on {server_host!r}, not loopback: a credential-free teacher is refused",
                code="teacher_credential_required", param="credential_id",
                hint="configure [teachers.credentials.<id>] with an HTTPS origin and pass credential_id")
        return url
    if url != credential.origin:
        raise InvalidRequest(
            f"url {url!r} is not the exact origin {credential.origin!r} of credential {credential.credential_id!r}",
            code="teacher_url_origin_mismatch", param="url", hint="pass the credential's origin as url")
    return url


def identity_revision(identity: TeacherIdentityV1) -> str:
    return sha256_hex(identity.compact_json())


def off_policy_manifest(alias: str, identity: TeacherIdentityV1, fingerprint: str) -> dict[str, Any]:
    """What an off-policy OPD teacher JSONL must bind: the alias, the exact identity and its fingerprint."""
    return {
        "schema": OFF_POLICY_SCHEMA,
        "teacher_alias": alias,
        "teacher_fingerprint": fingerprint,
        "identity_schema": IDENTITY_SCHEMA,
        "identity_revision": identity_revision(identity),
        "identity": identity.to_json(),
        "protocol": PROTOCOL,
        "row_format": {"token_ids": "list[int]", "prompt_logprobs": "list[null | {token_id: logprob}]"},
        "max_top_k": identity.max_top_k,
        "vocab_size": identity.vocab_size,
    }


def public_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """The API view of a stored entry (the stored entry never holds a secret; this adds derived fields)."""
    out = {k: entry.get(k) for k in ("alias", "kind", "provider", "model_id", "url", "credential_id", "adapter",
                                     "status", "usable", "reason", "fingerprint", "registered_at")}
    ident = entry.get("identity")
    if ident is not None:
        identity = _identity_of(ident)
        out["identity"] = identity.to_json()
        out["identity_revision"] = identity_revision(identity)
        out["bounds"] = {"max_top_k": identity.max_top_k, "max_model_len": identity.max_model_len,
                         "max_prompt_logprob_candidates": identity.max_prompt_logprob_candidates,
                         "vocab_size": identity.vocab_size,
                         "full_vocab": identity.max_top_k >= identity.vocab_size}
        out["off_policy_manifest"] = off_policy_manifest(entry["alias"], identity, entry["fingerprint"])
    else:
        out.update(identity=None, identity_revision=None, bounds=None, off_policy_manifest=None)
    return out


def _identity_of(obj: dict[str, Any]) -> TeacherIdentityV1:
    fields = {k: v for k, v in obj.items() if k not in ("schema", "protocol", "logprobs_mode")}
    return TeacherIdentityV1(**fields)


class TeacherRegistry:
    """The registry file and the operations behind ``/v1/teachers``."""

    def __init__(self, path: Path, *, credentials: dict[str, Any], server_host: str, timeout_s: float,
                 student: Callable[[], StudentFacts], local_teacher: Callable[[str | None], LocalTeacher]):
        self.path = Path(path)
        self.credentials = credentials
        self.server_host = server_host
        self.timeout_s = timeout_s
        self._student = student
        self._local = local_teacher
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self.migrated: list[str] = []
        self._load()

    # ------------------------------------------------------------- storage
    def _load(self) -> None:
        if not self.path.exists():
            return
        data = json.loads(self.path.read_text("utf-8"))
        teachers = data.get("teachers", {}) if isinstance(data, dict) else {}
        changed = False
        for alias, entry in teachers.items():
            if not isinstance(entry, dict):
                continue
            if "api_key_env" in entry:  # legacy: drop without trusting it; unusable until re-registered
                entry = {k: v for k, v in entry.items() if k != "api_key_env"}
                entry.update(status="needs_reregistration", usable=False,
                             reason="legacy entry carried api_key_env; delete it and register again with "
                                    "credential_id")
                self.migrated.append(alias)
                changed = True
            self._entries[alias] = entry
        if changed:
            log.warning("teacher registry: removed legacy api_key_env from %s; re-register them",
                        ", ".join(self.migrated))
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write_json(self.path, {"schema": REGISTRY_SCHEMA, "teachers": self._entries}, mode=REGISTRY_MODE)

    # ---------------------------------------------------------- operations
    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [public_entry(e) for _, e in sorted(self._entries.items())]

    def get(self, alias: str) -> dict[str, Any]:
        with self._lock:
            entry = self._entries.get(alias)
        if entry is None:
            raise NotFound(f"no teacher {alias!r}", code="teacher_not_found", hint="list teachers with GET /v1/teachers")
        return entry

    def show(self, alias: str) -> dict[str, Any]:
        return public_entry(self.get(alias))

    def delete(self, alias: str) -> dict[str, Any]:
        with self._lock:
            entry = self._entries.pop(alias, None)
            if entry is None:
                raise NotFound(f"no teacher {alias!r}", code="teacher_not_found")
            self._save()
        return public_entry(entry) | {"deleted": True}

    def client_for(self, entry: dict[str, Any]) -> RemoteTeacher | LocalTeacher:
        if entry["kind"] == "local":
            return self._local(entry.get("adapter"))
        cred = None if entry.get("credential_id") is None else resolve_credential(self.credentials,
                                                                                  entry["credential_id"])
        check_url(entry["url"], credential=cred, server_host=self.server_host)
        return RemoteTeacher(entry["url"], entry["model_id"], credential=cred, timeout_s=self.timeout_s)

    def register(self, req: TeacherRequest) -> dict[str, Any]:
        if len(self._entries) >= MAX_TEACHERS:
            raise Conflict(f"the registry holds {MAX_TEACHERS} teachers", code="teacher_registry_full")
        with self._lock:
            if req.alias in self._entries:
                raise Conflict(f"teacher alias {req.alias!r} exists; aliases are immutable",
                               code="teacher_alias_exists", hint="DELETE /v1/teachers/{alias} and register again")
        entry: dict[str, Any] = {"alias": req.alias, "kind": req.kind, "provider": req.provider,
                                 "model_id": req.model_id, "url": req.url, "credential_id": req.credential_id,
                                 "adapter": req.adapter}
        teacher = self.client_for(entry)
        report = self.probe(entry, teacher)
        entry.update(model_id=report.identity.served_model_id, fingerprint=report.fingerprint,
                     identity=report.identity.to_json(), status="ready", usable=True, reason=None,
                     registered_at=int(time.time()))
        with self._lock:
            if req.alias in self._entries:
                raise Conflict(f"teacher alias {req.alias!r} was registered meanwhile", code="teacher_alias_exists")
            self._entries[req.alias] = entry
            self._save()
        return public_entry(entry) | {"probes": {"top1_candidates": report.top1_candidates,
                                                 "max_k": report.max_k,
                                                 "max_k_candidates": report.max_k_candidates}}

    def probe(self, entry: dict[str, Any], teacher: RemoteTeacher | LocalTeacher | None = None,
              *, pinned: str | None = None) -> ProbeReport:
        teacher = teacher or self.client_for(entry)
        model_id = entry["model_id"] if entry["kind"] == "remote" else teacher.model_id
        return probe(teacher, self._student(), model_id=model_id, pinned=pinned)

    def pin(self, alias: str) -> dict[str, Any]:
        """The complete spec a job pins (refuses unusable aliases)."""
        entry = self.get(alias)
        if not entry.get("usable"):
            raise Conflict(f"teacher {alias!r} is not usable: {entry.get('reason')}", code="teacher_unusable",
                           hint="delete the alias and register it again")
        return dict(entry)
