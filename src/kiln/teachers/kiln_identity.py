"""Kiln as a teacher: a :class:`TeacherIdentityV1` that binds this process's runtime.

A Kiln server's scoring responses (``/v1/completions`` with ``prompt_logprobs``)
carry ``kiln-teacher-v1.<...>`` as ``system_fingerprint``, computed exactly as
the vLLM launcher computes it (:meth:`TeacherIdentityV1.fingerprint`) over an
identity whose fields Kiln fills like this:

=============================  ===============================================================
field                          what Kiln puts there
=============================  ===============================================================
served_model_id                the request's model: the base model ID, or the adapter's name
base_model_sha256              the loaded model's ``base_model_sha256`` (same Rust-loader digest)
tokenizer_vocab_sha256         :func:`tokenizer_vocab_digest` of the loaded tokenizer's ``get_vocab()``
tokenizer_config_sha256        :func:`tokenizer_config_digest` of ``backend_tokenizer.to_str()``
adapter                        ``null``, or ``{weights_sha256, config_sha256}`` of the served adapter files
vocab_size                     the model's vocabulary width (``config.vocab_size``)
max_top_k                      ``limits.max_prompt_logprobs``
max_model_len                  the engine's effective ``max_model_len``
max_prompt_logprob_candidates  the largest legal ceiling: min(1,000,000, max_model_len x row width)
implementation                 ``kiln:<kiln version>``
inference_config_sha256        digest of :func:`kiln_inference_document` (runtime versions, device, dtype,
                               config.json digest, the adapter's name and content revision, the bounds)
=============================  ===============================================================

Transport settings (host, port, API key) are not bound, as for the launcher.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

from kiln.canonical import canonical_json_bytes, domain_digest
from kiln.teachers.identity import (
    TeacherIdentityV1,
    adapter_weights_digest,
    resolve_candidate_ceiling,
    tokenizer_config_digest,
    tokenizer_vocab_digest,
)

KILN_INFERENCE_DOMAIN = "kiln.kiln-teacher-inference.v1"
KILN_INFERENCE_SCHEMA = "kiln.kiln-teacher-inference.v1"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def runtime_versions() -> dict[str, str]:
    from kiln import __version__

    return {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "kiln": __version__,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "peft": _version("peft"),
    }


def model_vocab_width(model: Any) -> int:
    return int(model.model.config.vocab_size)


def tokenizer_digests(tokenizer: Any, width: int) -> tuple[str, str]:
    """(vocab digest, backend-JSON digest) of a loaded fast tokenizer."""
    backend = tokenizer.backend_tokenizer
    vocab = tokenizer.get_vocab()
    return (tokenizer_vocab_digest(vocab, reported_size=backend.get_vocab_size(with_added_tokens=True),
                                   model_width=width),
            tokenizer_config_digest(backend.to_str()))


def adapter_identity(adapter_dir: Path) -> dict[str, str]:
    """``{weights_sha256, config_sha256}`` of a published PEFT adapter directory (safetensors)."""
    from kiln.canonical import sha256_file

    weights = "adapter_model.safetensors"
    digest, size = sha256_file(adapter_dir / weights)
    config_digest, _ = sha256_file(adapter_dir / "adapter_config.json")
    return {"weights_sha256": adapter_weights_digest(weights, size, digest), "config_sha256": config_digest}


def kiln_inference_document(*, model: Any, max_model_len: int, max_top_k: int, ceiling: int,
                            adapter: tuple[str, str] | None) -> dict[str, Any]:
    """Everything ``inference_config_sha256`` binds for a Kiln teacher (hashed canonically)."""
    config_bytes = (Path(model.path) / "config.json").read_bytes()
    return {
        "schema": KILN_INFERENCE_SCHEMA,
        "model_config_sha256": hashlib.sha256(config_bytes).hexdigest(),
        "runtime": {"versions": runtime_versions(), "executable": sys.executable},
        "device": str(model.device),
        "dtype": str(model.dtype),
        "max_model_len": max_model_len,
        "max_top_k": max_top_k,
        "max_prompt_logprob_candidates": ceiling,
        "logprobs_mode": "raw_logprobs",
        "adapter": None if adapter is None else {"name": adapter[0], "revision": adapter[1]},
    }


class KilnTeacherIdentity:
    """Computes (and caches per adapter revision) this server's teacher identity."""

    def __init__(self, model: Any, *, max_model_len: int, max_top_k: int):
        self.model = model
        self.max_model_len = max_model_len
        self.max_top_k = max_top_k
        self.vocab_size = model_vocab_width(model)
        self._tok: tuple[str, str] | None = None
        self._cache: dict[tuple[str, str | None, str | None], tuple[TeacherIdentityV1, dict[str, Any]]] = {}

    @property
    def usable(self) -> bool:
        return self.max_top_k >= 1

    def tokenizer(self) -> tuple[str, str]:
        if self._tok is None:
            self._tok = tokenizer_digests(self.model.tokenizer, self.vocab_size)
        return self._tok

    def identity(self, served_model_id: str, adapter: tuple[str, str, Path] | None = None) -> TeacherIdentityV1:
        """``adapter``: (name, content revision, directory) of the adapter the request runs on."""
        return self._computed(served_model_id, adapter)[0]

    def manifest(self, served_model_id: str, adapter: tuple[str, str, Path] | None = None) -> dict[str, Any]:
        """The teacher manifest (:mod:`kiln.teachers.inference_proof`): the identity, its fingerprint and the
        inference document whose digest is its ``inference_config_sha256``."""
        ident, doc = self._computed(served_model_id, adapter)
        return {"identity": ident.to_json(), "system_fingerprint": ident.fingerprint(), "inference_config": doc}

    def _computed(self, served_model_id: str,
                  adapter: tuple[str, str, Path] | None) -> tuple[TeacherIdentityV1, dict[str, Any]]:
        key = (served_model_id, None if adapter is None else adapter[0], None if adapter is None else adapter[1])
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        ceiling = resolve_candidate_ceiling(None, self.max_top_k, self.max_model_len, self.vocab_size)
        vocab_sha, config_sha = self.tokenizer()
        doc = kiln_inference_document(model=self.model, max_model_len=self.max_model_len, max_top_k=self.max_top_k,
                                      ceiling=ceiling, adapter=None if adapter is None else adapter[:2])
        from kiln import __version__

        ident = TeacherIdentityV1(
            served_model_id=served_model_id,
            base_model_sha256=self.model.base_model_sha256,
            tokenizer_vocab_sha256=vocab_sha,
            tokenizer_config_sha256=config_sha,
            adapter=None if adapter is None else adapter_identity(Path(adapter[2])),
            vocab_size=self.vocab_size,
            max_top_k=self.max_top_k,
            max_model_len=self.max_model_len,
            max_prompt_logprob_candidates=ceiling,
            implementation=f"kiln:{__version__}",
            inference_config_sha256=domain_digest(KILN_INFERENCE_DOMAIN, canonical_json_bytes(doc)),
        )
        self._cache[key] = (ident, doc)
        return ident, doc


MAX_FINGERPRINT_NESTING = 8  # JSON objects/arrays in an identity payload (it has two)


def decode_fingerprint(fingerprint: str) -> dict[str, Any]:
    """The identity JSON a ``kiln-teacher-v1.<b64>.<sha256>`` fingerprint carries, after checking its digest.

    Raises ``ValueError`` naming what is wrong (a stock ``vllm-*`` fingerprint, bad encoding, digest mismatch).
    """
    import base64

    from kiln.canonical import sha256_hex
    from kiln.teachers.identity import FINGERPRINT_PREFIX

    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError("the response carries no system_fingerprint")
    parts = fingerprint.split(".")
    if len(parts) != 3 or parts[0] != FINGERPRINT_PREFIX:
        shown = fingerprint if len(fingerprint) <= 80 else fingerprint[:80] + "..."
        raise ValueError(f"fingerprint {shown!r} is not a canonical {FINGERPRINT_PREFIX} fingerprint "
                         "(stock vllm-* fingerprints prove nothing about the model; launch the teacher with "
                         "`kiln teacher launch`)")
    try:
        raw = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"fingerprint payload is not base64url: {exc}") from None
    if sha256_hex(raw) != parts[2]:
        raise ValueError("fingerprint digest does not match its identity payload")
    # The identity is a flat object (one nested adapter object): bound the nesting before parsing,
    # so a payload nested 100,000 deep is refused here, not by the parser's recursion limit.
    if raw.count(b"[") + raw.count(b"{") > MAX_FINGERPRINT_NESTING:
        raise ValueError(f"fingerprint payload has more than {MAX_FINGERPRINT_NESTING} JSON objects/arrays; "
                         "an identity is a flat object")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("fingerprint payload is not UTF-8") from None
    except RecursionError:
        raise ValueError("fingerprint payload nests too deeply") from None
    except ValueError as exc:
        raise ValueError(f"fingerprint payload is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("fingerprint payload is not a JSON object")
    return obj


def identity_from_fingerprint(fingerprint: str) -> TeacherIdentityV1:
    """Rebuild and re-validate the identity; its own fingerprint must equal the one given (canonical form)."""
    from kiln.teachers.identity import IDENTITY_FIELDS, IDENTITY_SCHEMA, LOGPROBS_MODE, PROTOCOL

    obj = decode_fingerprint(fingerprint)
    if list(obj) != list(IDENTITY_FIELDS):
        raise ValueError(f"fingerprint identity fields {list(obj)} are not the normative {list(IDENTITY_FIELDS)}")
    if (obj["schema"], obj["protocol"], obj["logprobs_mode"]) != (IDENTITY_SCHEMA, PROTOCOL, LOGPROBS_MODE):
        raise ValueError("fingerprint identity has the wrong schema, protocol or logprobs_mode")
    fields = {k: v for k, v in obj.items() if k not in ("schema", "protocol", "logprobs_mode")}
    ident = TeacherIdentityV1(**fields)
    if ident.fingerprint() != fingerprint:
        raise ValueError("fingerprint is not in canonical form")
    return ident
