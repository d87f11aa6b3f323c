"""Training receipts: how an adapter revision was made, stored beside its manifest and bound to it by digest.

Every training job (SFT, GRPO, OPD, KD) publishes ``kiln-receipt.json``
(``kiln.training-receipt.v1``) into the revision directory together with the
adapter files and ``kiln-manifest.json``: the store writes it into the staging
directory after the manifest and one ``rename`` publishes all three. The receipt is
not one of the manifest's ``files`` (the revision ID covers the adapter's content
only, so it is unchanged); it names the revision and the SHA-256 of the exact
manifest bytes instead, and repeats what the manifest commits to (kind, base
model, inputs digest, parent, config digest), so :func:`check_receipt` finds a
receipt moved to, or edited against, another revision. What the job states before
publication (its claims: job, plan digest, inputs' digests, teacher, code version)
is hashed into the manifest config as ``receipt_sha256``, so the revision ID covers
it and an edited claim is found too. A post-train eval gate
runs after publication; its verdict is added to the receipt by one atomic rewrite
(:meth:`kiln.adapters.store.AdapterStore.record_gate`).

:func:`adapter_binding` and :func:`write_receipt` are the one way Kiln records an
adapter revision in a receipt; OpenEnv's run receipt (``train_receipt.json``) uses
both. Standard library only (plus :mod:`kiln.canonical`).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any

from kiln.adapters.errors import AdapterIntegrityError
from kiln.adapters.manifest import Manifest, load_json_object, read_store_file
from kiln.canonical import (
    atomic_write_bytes,
    canonical_json_bytes,
    canonical_sha256,
    domain_digest,
    sha256_hex,
)

RECEIPT_FILE = "kiln-receipt.json"
RECEIPT_SCHEMA = "kiln.training-receipt.v1"
TRAINED_KINDS = ("sft", "grpo", "opd", "kd")  # manifest kinds a training job publishes (each with a receipt)
MAX_RECEIPT_BYTES = 256 * 1024
GIT_TIMEOUT_S = 5.0
_BINDING = ("name", "revision", "manifest_sha256", "kind", "base_model_sha256", "inputs_sha256",
            "parent_revision", "config_sha256")
_KEYS = {"schema", "adapter", "job_id", "plan_sha256", "inputs", "teacher", "code", "gate"}
# claims a receipt may carry or not: receipts written before they existed verify unchanged
_OPTIONAL_KEYS = {"locality"}


def config_sha256(config: dict[str, Any]) -> str:
    """SHA-256 of the manifest config's canonical JSON (the job's effective configuration)."""
    return canonical_sha256(config)


def adapter_binding(manifest: Manifest, manifest_bytes: bytes) -> dict[str, Any]:
    """What binds a receipt to one stored revision: its name and ID, the SHA-256 of the manifest's exact
    bytes, and the manifest's commitments a reader checks against (kind, base, inputs, parent, config)."""
    return {"name": manifest.name, "revision": manifest.revision, "manifest_sha256": sha256_hex(manifest_bytes),
            "kind": manifest.kind, "base_model_sha256": manifest.base_model_sha256,
            "inputs_sha256": manifest.inputs_sha256, "parent_revision": manifest.parent_revision,
            "config_sha256": config_sha256(manifest.config)}


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, str | None]:
    """Kiln's version and, when the package runs from a git checkout, its commit (else None)."""
    from kiln import __version__

    commit = None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                             env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
        if out.returncode == 0 and len(out.stdout.strip()) in (40, 64):
            commit = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"kiln_version": __version__, "git_commit": commit}


def training_claims(*, job_id: str, plan_sha256: str, inputs: dict[str, Any], teacher: dict[str, Any] | None,
                    locality: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a training job states before publication: the job, its plan digest, its inputs' digests, the
    teacher it learned from (OPD, KD), the code that ran it and, when measured, its adapter's ``locality``
    (:mod:`kiln.training.core.locality`, with the locality guard's verdict). Their :func:`claims_sha256` goes into
    the manifest config as ``receipt_sha256``, so the revision ID covers them."""
    claims = {"schema": RECEIPT_SCHEMA, "job_id": job_id, "plan_sha256": plan_sha256, "inputs": inputs,
              "teacher": teacher, "code": code_version()}
    return claims | ({"locality": locality} if locality is not None else {})


LOCALITY_SUMMARY = ("probes", "unchanged", "unchanged_fraction", "kl_mean", "degenerate", "base_degenerate",
                    "scope", "auto_scope")  # scope: {in, out} of a scoped adapter; auto_scope: why "auto" scoped it


def locality_summary(locality: Any) -> dict[str, Any] | None:
    """What a listing shows of a receipt's ``locality``: the figures, and the guard's ``admitted``, ``code`` and
    ``override`` (None when the receipt has none: written before jobs measured it, or the measure was off)."""
    if not isinstance(locality, dict) or locality.get("measured") is False:
        return None
    raw_guard = locality.get("guard")
    guard = raw_guard if isinstance(raw_guard, dict) else {}
    return {**{k: locality.get(k) for k in LOCALITY_SUMMARY}, "error": locality.get("error"),
            "guard": {k: guard.get(k) for k in ("admitted", "code", "override")}}


def claims_sha256(claims: dict[str, Any]) -> str:
    return domain_digest(RECEIPT_SCHEMA, canonical_json_bytes(claims))


def bind(claims: dict[str, Any], manifest: Manifest, manifest_bytes: bytes) -> dict[str, Any]:
    """The receipt of ``claims`` for the revision ``manifest`` describes (no gate verdict yet)."""
    return {**claims, "adapter": adapter_binding(manifest, manifest_bytes), "gate": None}


def encode_receipt(body: dict[str, Any]) -> bytes:
    """A receipt's bytes: canonical JSON and a newline."""
    return canonical_json_bytes(body) + b"\n"


def write_receipt(path: Path, data: bytes) -> tuple[str, int]:
    """Write encoded receipt bytes crash-safely (temp + fsync + rename, 0600); returns ``(sha256, bytes)``."""
    atomic_write_bytes(path, data, mode=0o600)
    return sha256_hex(data), len(data)


def store_receipt(path: Path, body: dict[str, Any]) -> None:
    """Write a training receipt (at most ``MAX_RECEIPT_BYTES``)."""
    data = encode_receipt(body)
    if len(data) > MAX_RECEIPT_BYTES:
        raise AdapterIntegrityError(f"a receipt of {len(data)} bytes exceeds the limit of {MAX_RECEIPT_BYTES}")
    write_receipt(path, data)


def read_receipt(path: Path) -> dict[str, Any]:
    try:
        data = read_store_file(path, limit=MAX_RECEIPT_BYTES, error=AdapterIntegrityError)
    except (FileNotFoundError, NotADirectoryError):
        raise AdapterIntegrityError(f"{path.name} is missing") from None
    return load_json_object(data, limit=MAX_RECEIPT_BYTES, what=path.name, error=AdapterIntegrityError)


def check_receipt(body: dict[str, Any], manifest: Manifest, manifest_bytes: bytes) -> list[str]:
    """Every way ``body`` fails to be the training receipt of exactly this revision (empty: it binds).

    The claims (all but ``adapter`` and ``gate``; ``locality`` only in receipts of jobs that measured it) must hash to the manifest config's ``receipt_sha256``
    (so an edited claim changes nothing the revision covers without being found), and ``adapter`` must
    equal what the manifest states (name, revision, the manifest's own SHA-256, kind, base, inputs,
    parent, config digest)."""
    if body.get("schema") != RECEIPT_SCHEMA or not _KEYS <= set(body) <= _KEYS | _OPTIONAL_KEYS:
        return [f"not a {RECEIPT_SCHEMA} receipt (schema {body.get('schema')!r}, keys {sorted(body)})"]
    problems = []
    have = body["adapter"] if isinstance(body["adapter"], dict) else {}
    want = adapter_binding(manifest, manifest_bytes)
    for key in _BINDING:
        if have.get(key) != want[key]:
            problems.append(f"receipt adapter.{key} {have.get(key)!r} differs from the revision's {want[key]!r}")
    committed = manifest.config.get("receipt_sha256")
    claims = {k: v for k, v in body.items() if k not in ("adapter", "gate")}
    if committed is None:
        problems.append("the manifest commits to no receipt (config has no receipt_sha256)")
    elif claims_sha256(claims) != committed:
        problems.append(f"the receipt's claims hash to {claims_sha256(claims)}, the manifest commits to {committed}")
    if body["job_id"] != manifest.config.get("job_id"):
        problems.append(f"receipt job_id {body['job_id']!r} differs from the manifest's "
                        f"{manifest.config.get('job_id')!r}")
    pinned = manifest.config.get("teacher_fingerprint")
    teacher = body["teacher"] if isinstance(body["teacher"], dict) else {}
    if pinned is not None and teacher.get("fingerprint") != pinned:
        problems.append(f"receipt teacher fingerprint {teacher.get('fingerprint')!r} differs from the "
                        f"manifest's teacher_fingerprint {pinned!r}")
    return problems
