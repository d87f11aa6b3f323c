"""The Kiln adapter manifest (``kiln-manifest.json``) and content revision IDs.

A manifest binds a stored adapter to the base model it was trained for, how it
was made (kind + effective config + digest of the training inputs + parent
revision) and the exact bytes of every file. The revision ID is a
domain-separated SHA-256 over those content commitments only; the adapter's name
and creation time are deliberately left out, so identical content always gets the
identical revision, whatever it is called and whenever it was published.

Standard library only (plus :mod:`kiln.canonical`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Iterable

from kiln.adapter_names import MAX_ADAPTER_NAME_CHARS, NAME_RE, is_valid_name  # noqa: F401  (the one name rule)
from kiln.adapters.errors import InvalidAdapter
from kiln.canonical import (
    CanonicalJSONError,
    FileTooLargeError,
    NotRegularFileError,
    canonical_json_bytes,
    domain_digest,
    is_lower_hex64,
    read_regular_file,
    strict_json_loads,
)

MANIFEST_SCHEMA = "kiln.adapter-manifest.v1"
REVISION_DOMAIN = "kiln.adapter-revision.v1"
MANIFEST_FILE = "kiln-manifest.json"
KINDS = ("sft", "grpo", "opd", "kd", "merge", "upload")
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_CONFIG_BYTES = 256 * 1024
MAX_MANIFEST_FILES = 64
# The one LoRA rank limit (uploads, merges, training requests); it also bounds an upload's expanded size.
MAX_LORA_RANK = 1024
# Response header naming the adapter revision that produced (or is) the payload.
ADAPTER_REVISION_HEADER = "x-kiln-adapter-revision"
_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def read_store_file(path: Any, *, limit: int, error: type[Exception]) -> bytes:
    """The bytes of one file of the adapter store (a manifest, receipt, HEAD, quarantine or served-set
    file), read by :func:`kiln.canonical.read_regular_file`: a FIFO, directory, socket, device or symlink
    in its place, a file over ``limit`` bytes or one that cannot be read raises ``error`` naming it at
    once (never a blocking open); a missing one raises ``FileNotFoundError``/``NotADirectoryError``."""
    try:
        return read_regular_file(path, limit)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except NotRegularFileError as exc:
        raise error(f"{path.name} is not a regular file ({exc.strerror})") from None
    except FileTooLargeError:
        raise error(f"{path.name} is larger than the limit of {limit} bytes") from None
    except OSError as exc:
        raise error(f"{path.name} cannot be read: {exc.strerror or exc}") from None


def load_json_object(data: bytes, *, limit: int, what: str, error: type[Exception]) -> dict[str, Any]:
    """A small untrusted JSON document that must be one object (a manifest, a receipt): at most ``limit``
    bytes of strict JSON (:func:`kiln.canonical.strict_json_loads`); anything else raises ``error``."""
    if len(data) > limit:
        raise error(f"{what} is {len(data)} bytes; the limit is {limit}")
    try:
        obj = strict_json_loads(data)
    except CanonicalJSONError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise error(f"{what} must be a JSON object")
    return obj


def shorten(text: object, limit: int = 80) -> str:
    """``repr`` of untrusted text for an error message, cut to about ``limit`` characters."""
    shown = repr(text[: limit + 1] if isinstance(text, (str, bytes)) else text)
    return shown if len(shown) <= limit + 2 else shown[:limit] + "...(truncated)"


def check_name(name: object) -> str:
    """Validate an adapter name: 1-64 of ``A-Z a-z 0-9 . _ -``, not starting with a dot, ``_`` or ``-``."""
    if not is_valid_name(name):
        raise InvalidAdapter(
            f"invalid adapter name {shorten(name)}",
            hint=f"Use 1-{MAX_ADAPTER_NAME_CHARS} letters, digits, '.', '_' or '-', starting with a letter or digit.",
        )
    return name  # type: ignore[return-value]


def check_revision(revision: object, what: str = "revision") -> str:
    if not is_lower_hex64(revision):
        raise InvalidAdapter(f"{what} {revision!r} is not a 64-character lowercase hex SHA-256")
    return revision  # type: ignore[return-value]


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def _check_content(
    base_model_sha256: object, kind: object, config: object, inputs_sha256: object, parent_revision: object
) -> None:
    check_revision(base_model_sha256, "base_model_sha256")
    if kind not in KINDS:
        raise InvalidAdapter(f"unknown adapter kind {kind!r}; expected one of {', '.join(KINDS)}")
    if not isinstance(config, dict):
        raise InvalidAdapter("config must be a JSON object")
    try:
        size = len(canonical_json_bytes(config))
    except CanonicalJSONError as exc:
        raise InvalidAdapter(f"config is not canonical JSON: {exc}") from exc
    if size > MAX_CONFIG_BYTES:
        raise InvalidAdapter(f"config is {size} bytes; the limit is {MAX_CONFIG_BYTES}")
    if inputs_sha256 is not None:
        check_revision(inputs_sha256, "inputs_sha256")
    if parent_revision is not None:
        check_revision(parent_revision, "parent_revision")


@dataclass(frozen=True)
class Manifest:
    name: str
    revision: str
    base_model_sha256: str
    kind: str
    config: dict[str, Any]
    inputs_sha256: str | None
    parent_revision: str | None
    files: tuple[FileEntry, ...]
    created: str

    @property
    def size(self) -> int:
        """Total bytes of the adapter files (the manifest itself not included)."""
        return sum(f.size for f in self.files)

    def commitments(self) -> dict[str, Any]:
        """Everything the revision covers: content, base, provenance; not the name or the time."""
        return {
            "schema": MANIFEST_SCHEMA,
            "base_model_sha256": self.base_model_sha256,
            "kind": self.kind,
            "config": self.config,
            "inputs_sha256": self.inputs_sha256,
            "parent_revision": self.parent_revision,
            "files": [f.to_dict() for f in self.files],
        }

    @classmethod
    def build(
        cls,
        *,
        name: str,
        files: Iterable[FileEntry],
        base_model_sha256: str,
        kind: str,
        config: dict[str, Any],
        inputs_sha256: str | None,
        parent_revision: str | None,
        created: str | None = None,
    ) -> "Manifest":
        """Check the fields and compute the revision:
        sha256(REVISION_DOMAIN + NUL + canonical JSON of :meth:`commitments`)."""
        check_name(name)
        _check_content(base_model_sha256, kind, config, inputs_sha256, parent_revision)
        draft = cls(
            name=name,
            revision="",
            base_model_sha256=base_model_sha256,
            kind=kind,
            config=config,
            inputs_sha256=inputs_sha256,
            parent_revision=parent_revision,
            files=tuple(sorted(files, key=lambda f: f.path)),
            created=created or utc_now(),
        )
        revision = domain_digest(REVISION_DOMAIN, canonical_json_bytes(draft.commitments()))
        return replace(draft, revision=revision)

    def to_dict(self) -> dict[str, Any]:
        """The manifest document (field order is cosmetic: it is written as canonical JSON)."""
        return {"name": self.name, "revision": self.revision, **self.commitments(), "created": self.created}

    def to_bytes(self) -> bytes:
        return canonical_json_bytes(self.to_dict()) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        """Parse and fully check a manifest, including that its revision matches its content."""
        obj = load_json_object(data, limit=MAX_MANIFEST_BYTES, what="manifest", error=InvalidAdapter)
        expected = {
            "schema", "name", "revision", "base_model_sha256", "kind", "config",
            "inputs_sha256", "parent_revision", "files", "created",
        }
        if set(obj) != expected:
            raise InvalidAdapter(f"manifest keys {sorted(obj)} differ from the schema's {sorted(expected)}")
        if obj["schema"] != MANIFEST_SCHEMA:
            raise InvalidAdapter(f"manifest schema {obj['schema']!r} is not {MANIFEST_SCHEMA!r}")
        raw_files = obj["files"]
        if not isinstance(raw_files, list) or not raw_files or len(raw_files) > MAX_MANIFEST_FILES:
            raise InvalidAdapter(f"manifest files must be a list of 1-{MAX_MANIFEST_FILES} entries")
        files = []
        for entry in raw_files:
            if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"}:
                raise InvalidAdapter("each manifest file entry needs exactly path, size and sha256")
            path, size, digest = entry["path"], entry["size"], entry["sha256"]
            if not isinstance(path, str) or not _FILE_RE.fullmatch(path) or path == MANIFEST_FILE:
                raise InvalidAdapter(f"manifest file path {path!r} is not a plain file name")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidAdapter(f"manifest size of {path} is not a non-negative integer")
            check_revision(digest, f"sha256 of {path}")
            files.append(FileEntry(path, size, digest))
        if len({f.path for f in files}) != len(files):
            raise InvalidAdapter("manifest lists a file twice")
        if not isinstance(obj["created"], str) or len(obj["created"]) > 64:
            raise InvalidAdapter("manifest created must be a short timestamp string")
        content = {k: obj[k] for k in ("base_model_sha256", "kind", "config", "inputs_sha256", "parent_revision")}
        manifest = cls.build(name=obj["name"], files=files, created=obj["created"], **content)
        if manifest.revision != obj["revision"]:
            raise InvalidAdapter(
                f"manifest revision {obj['revision']} does not match its content ({manifest.revision})",
                hint="The manifest was edited after publication; delete and republish the adapter.",
            )
        return manifest


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
