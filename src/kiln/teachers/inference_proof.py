"""Proving which ``config.json`` a remote teacher serves: the teacher manifest and its check.

A ``kiln-teacher-v1`` fingerprint names the model's weights (``base_model_sha256``) and
tokenizer directly, but binds ``config.json`` only inside ``inference_config_sha256``,
a digest over a whole inference document. Over the wire a capture therefore cannot
see the config digest an AutoDistill plan lists for its teacher. The *teacher
manifest* is the preimage that makes it checkable:

.. code-block:: json

    {"identity": {...}, "system_fingerprint": "kiln-teacher-v1....", "inference_config": {...}}

``kiln teacher launch --manifest-only`` (the vLLM launcher) prints it, and a Kiln
server that acts as a teacher answers it at ``GET /v1/teacher/manifest``. The
check (:func:`verified_model_config`) needs no trust in the file's author: its
fingerprint must be the one pinned at registration, and the canonical digest of its
``inference_config`` under the identity's domain (vLLM launcher or Kiln, chosen by
``implementation``) must be that fingerprint's ``inference_config_sha256``. Only then
is the document's ``model_config_sha256`` the teacher's config digest.

Pure contract code: no torch, transformers or vLLM.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kiln.canonical import canonical_json_bytes, domain_digest
from kiln.teachers.identity import INFERENCE_CONFIG_DOMAIN, TeacherIdentityV1
from kiln.teachers.kiln_identity import KILN_INFERENCE_DOMAIN

__all__ = ["MAX_MANIFEST_BYTES", "TeacherManifest", "TeacherManifestError", "parse_teacher_manifest",
           "verified_model_config"]

MAX_MANIFEST_BYTES = 1 << 20  # the inference document is a few KiB; anything near this is not one
_HEX64 = re.compile(r"[0-9a-f]{64}")


class TeacherManifestError(ValueError):
    """The teacher manifest is malformed or does not prove what it claims."""


@dataclass(frozen=True)
class TeacherManifest:
    system_fingerprint: str
    inference_config: dict[str, Any]


def parse_teacher_manifest(data: bytes) -> TeacherManifest:
    """Strict parse: a JSON object with ``system_fingerprint`` (str) and ``inference_config`` (object)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise TeacherManifestError(f"teacher manifest is {len(data)} bytes; the limit is {MAX_MANIFEST_BYTES}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TeacherManifestError(f"teacher manifest is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TeacherManifestError("teacher manifest must be a JSON object")
    fp, doc = obj.get("system_fingerprint"), obj.get("inference_config")
    if not isinstance(fp, str) or not isinstance(doc, dict):
        raise TeacherManifestError("teacher manifest needs 'system_fingerprint' (string) and 'inference_config' "
                                   "(object): print it with `kiln teacher launch ... --manifest-only`, or fetch "
                                   "GET /v1/teacher/manifest from a Kiln teacher")
    return TeacherManifest(system_fingerprint=fp, inference_config=doc)


def _domain(identity: TeacherIdentityV1) -> str:
    if identity.implementation.startswith("vllm:"):
        return INFERENCE_CONFIG_DOMAIN
    if identity.implementation.startswith("kiln:"):
        return KILN_INFERENCE_DOMAIN
    raise TeacherManifestError(f"no inference-document domain is known for implementation {identity.implementation!r}")


def verified_model_config(manifest: TeacherManifest, identity: TeacherIdentityV1, pinned_fingerprint: str) -> str:
    """The teacher's ``config.json`` SHA-256, proven by ``manifest`` against the pinned identity."""
    if manifest.system_fingerprint != pinned_fingerprint:
        raise TeacherManifestError("the teacher manifest is for another teacher: its fingerprint differs from the "
                                   "one pinned at registration")
    got = domain_digest(_domain(identity), canonical_json_bytes(manifest.inference_config))
    if got != identity.inference_config_sha256:
        raise TeacherManifestError(f"the manifest's inference_config digests to {got}, the pinned identity binds "
                                   f"inference_config_sha256 {identity.inference_config_sha256}")
    config = manifest.inference_config.get("model_config_sha256")
    if not isinstance(config, str) or not _HEX64.fullmatch(config):
        raise TeacherManifestError("the manifest's inference_config has no model_config_sha256")
    return config
