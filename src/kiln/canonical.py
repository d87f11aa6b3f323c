"""Canonical JSON, SHA-256 helpers, domain-separated digests and atomic publication.

This is the one place in Kiln that turns values into hashable bytes and durable
files. The teacher identity, the autodistill contract, adapter manifests and
receipts all call into it; nothing else in the tree should re-implement these
rules.

Standard library only: the vLLM teacher launcher imports this module from inside
the vLLM environment, and the pure contract modules must not pull in torch,
transformers or vLLM.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import json
import os
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "CanonicalJSONError",
    "JSONLNormalizationError",
    "JSONL_C14N_ALGORITHM",
    "canonical_json",
    "canonical_json_bytes",
    "ordered_json_bytes",
    "sha256_hex",
    "sha256_file",
    "NotRegularFileError",
    "FileTooLargeError",
    "open_regular",
    "read_regular_file",
    "canonical_sha256",
    "domain_digest",
    "base64url_nopad",
    "strict_json_loads",
    "JSONLDigest",
    "jsonl_c14n",
    "base_model_digest",
    "fsync_dir",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_publish_dir",
    "is_lower_hex64",
]

JSONL_C14N_ALGORITHM = "soup-jsonl-c14n-v1"
_HASH_CHUNK = 1 << 20


class CanonicalJSONError(ValueError):
    """A value cannot be represented as canonical JSON (NaN, Infinity, odd types)."""


class JSONLNormalizationError(ValueError):
    """A JSONL source violates soup-jsonl-c14n-v1; ``row`` is 1-based when known."""

    def __init__(self, message: str, row: int | None = None):
        self.row = row
        super().__init__(f"row {row}: {message}" if row is not None else message)


# --------------------------------------------------------------------------- JSON


def canonical_json(value: Any) -> str:
    """Serialize with sorted keys, no insignificant whitespace, no NaN/Infinity.

    Unicode code points are written as themselves (not ``\\u`` escaped) so the UTF-8
    bytes of the result are the canonical form.
    """
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # NaN / Infinity / circular
        raise CanonicalJSONError(f"value is not canonical JSON: {exc}") from exc
    except TypeError as exc:
        raise CanonicalJSONError(f"value is not JSON-serializable: {exc}") from exc


def canonical_json_bytes(value: Any) -> bytes:
    try:
        return canonical_json(value).encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogate from a "\ud800" escape
        raise CanonicalJSONError(f"string is not encodable as UTF-8: {exc}") from exc


def ordered_json_bytes(value: Any) -> bytes:
    """Compact JSON that keeps the caller's key order (for normative field orders)."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, TypeError) as exc:
        raise CanonicalJSONError(f"value is not JSON-serializable: {exc}") from exc


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_sha256(value: Any) -> str:
    """SHA-256 (lowercase hex) of the canonical JSON bytes of ``value``."""
    return sha256_hex(canonical_json_bytes(value))


class NotRegularFileError(OSError):
    """A path names a FIFO, directory, socket, device or symlink where a regular file belongs."""


class FileTooLargeError(OSError):
    """A regular file holds more bytes than its reader's limit (found before reading it whole)."""


_REGULAR_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                       | getattr(os, "O_CLOEXEC", 0))


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A blocking read descriptor on the regular file ``path`` (relative to ``dir_fd`` when given).

    The one way Kiln opens a file it did not just write (its store, KILN_HOME, an operator's path):
    ``O_NONBLOCK`` so a FIFO never waits for a writer, ``O_NOFOLLOW`` so a final symlink is refused,
    then ``fstat`` before any byte is read; anything but a regular file raises
    :class:`NotRegularFileError` (a missing file raises ``FileNotFoundError`` as ``open`` does)."""
    try:
        fd = os.open(path, _REGULAR_OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(errno.ELOOP, f"{os.fspath(path)} is a symlink; refused") from None
        if exc.errno == errno.ENXIO:  # a socket or a device with nothing behind it
            raise NotRegularFileError(errno.ENXIO, f"{os.fspath(path)} is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode) else "special file"
            raise NotRegularFileError(errno.EINVAL, f"{os.fspath(path)} is a {kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: str | os.PathLike[str], max_bytes: int, *, dir_fd: int | None = None) -> bytes:
    """All bytes of the regular file ``path`` (see :func:`open_regular`), at most ``max_bytes``:
    a larger file raises :class:`FileTooLargeError`, found by ``fstat`` before reading and again
    while reading (a file that grows meanwhile); never more than ``max_bytes + 1`` bytes are read."""
    fd = open_regular(path, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLargeError(errno.EFBIG, f"{os.fspath(path)} is {size} bytes, over the limit of {max_bytes}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(errno.EFBIG, f"{os.fspath(path)} grew past the limit of {max_bytes} bytes")
    return data


def sha256_file(path: str | os.PathLike[str], *, expected_size: int | None = None) -> tuple[str, int]:
    """Stream a regular file's SHA-256 and byte count (:func:`open_regular`: no FIFO, no final symlink)."""
    fd = open_regular(path)
    h = hashlib.sha256()
    n = 0
    with os.fdopen(fd, "rb") as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    if expected_size is not None and n != expected_size:
        raise ValueError(f"{path}: expected {expected_size} bytes, read {n}")
    return h.hexdigest(), n


def domain_digest(domain: str, *parts: bytes) -> str:
    """SHA-256 over ``domain`` + NUL + the concatenated parts (domain separation)."""
    if "\x00" in domain:
        raise ValueError("domain must not contain NUL")
    h = hashlib.sha256(domain.encode("utf-8") + b"\x00")
    for p in parts:
        h.update(p)
    return h.hexdigest()


def base64url_nopad(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def is_lower_hex64(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == 64
        and all(c in "0123456789abcdef" for c in value)
    )


def _reject_constant(name: str) -> Any:
    raise CanonicalJSONError(f"non-finite number {name} is not allowed")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise CanonicalJSONError(f"number {literal[:40]} overflows to a non-finite float")
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, val in pairs:
        if key in out:
            raise CanonicalJSONError(f"duplicate object key {key!r}")
        out[key] = val
    return out


def strict_json_loads(text: str | bytes) -> Any:
    """Parse JSON rejecting duplicate keys and NaN/Infinity literals."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CanonicalJSONError(f"not UTF-8: {exc}") from exc
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as exc:
        raise CanonicalJSONError(f"malformed JSON: {exc}") from exc
    except (RecursionError, ValueError) as exc:  # too deep, or int beyond the digit limit
        if isinstance(exc, CanonicalJSONError):
            raise
        raise CanonicalJSONError(f"JSON value not accepted: {exc}") from exc


# -------------------------------------------------------------------------- JSONL


@dataclass(frozen=True)
class JSONLDigest:
    """Result of ``soup-jsonl-c14n-v1`` over one source."""

    rows: int
    source_bytes: int
    source_sha256: str
    normalized_bytes: int
    normalized_sha256: str
    normalized: bytes
    algorithm: str = JSONL_C14N_ALGORITHM

    def objects(self) -> list[dict[str, Any]]:
        # Split on LF only: canonical rows may hold U+2028/U+2029 inside strings.
        return [json.loads(line) for line in self.normalized.decode("utf-8").split("\n")[:-1]]


def jsonl_c14n(source: bytes, *, max_rows: int | None = None) -> JSONLDigest:
    """Normalize JSONL bytes per ``soup-jsonl-c14n-v1``.

    One leading UTF-8 BOM is removed; \\r\\n, \\r and \\n all end a row; blank rows,
    duplicate keys, malformed JSON and non-object rows are rejected; every row is
    re-serialized canonically and terminated by one LF.
    """
    try:
        text = source.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONLNormalizationError(f"not UTF-8: {exc}") from exc
    if text.startswith("\ufeff"):
        text = text[1:]
    # Universal newlines: only CR, LF and CRLF split rows (str.splitlines would also
    # split on U+2028 and friends, which are legal inside JSON strings).
    lines = io.StringIO(text, newline=None).read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    out = bytearray()
    for i, line in enumerate(lines, start=1):
        if max_rows is not None and i > max_rows:
            raise JSONLNormalizationError(f"more than {max_rows} rows")
        if line.strip() == "":
            raise JSONLNormalizationError("blank row", row=i)
        try:
            obj = strict_json_loads(line)
        except CanonicalJSONError as exc:
            raise JSONLNormalizationError(str(exc), row=i) from exc
        if not isinstance(obj, dict):
            raise JSONLNormalizationError("row is not a JSON object", row=i)
        try:
            out += canonical_json_bytes(obj) + b"\n"
        except CanonicalJSONError as exc:
            raise JSONLNormalizationError(str(exc), row=i) from exc
    norm = bytes(out)
    return JSONLDigest(
        rows=len(lines),
        source_bytes=len(source),
        source_sha256=sha256_hex(source),
        normalized_bytes=len(norm),
        normalized_sha256=sha256_hex(norm),
        normalized=norm,
    )


# ------------------------------------------------------------ model identity


BASE_MODEL_DOMAIN = "kiln.base-model-content.v1"


def base_model_digest(shards: Iterable[tuple[str, int]]) -> str:
    """``base_model_sha256`` from (sha256 hex, byte length) of every safetensors shard.

    Records are sorted by digest then length; the hash covers the domain with its
    NUL, the little-endian u64 record count, then each record's little-endian u64
    length followed by its raw 32-byte digest.
    """
    records = sorted((bytes.fromhex(d), int(n)) for d, n in shards)
    parts = [struct.pack("<Q", len(records))]
    for digest, length in records:
        if len(digest) != 32:
            raise ValueError("shard digest must be 32 bytes")
        parts.append(struct.pack("<Q", length) + digest)
    return domain_digest(BASE_MODEL_DOMAIN, *parts)


# ------------------------------------------------------------ atomic publication


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` via temp file, fsync, rename, fsync parent.

    Readers see the old file or the new one, never a torn write.
    """
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(parent)


def atomic_write_json(path: str | os.PathLike[str], value: Any, *, mode: int = 0o644) -> None:
    atomic_write_bytes(path, canonical_json_bytes(value) + b"\n", mode=mode)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def atomic_publish_dir(staging: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Durably move a fully written staging directory to ``final`` in one rename.

    ``final`` must not exist (publication never overwrites); both paths must be on
    one filesystem. Every file is fsynced before the rename and the parent after it.
    """
    staging, final = Path(staging), Path(final)
    if final.exists() or final.is_symlink():
        raise FileExistsError(f"refusing to overwrite {final}")
    _fsync_tree(staging)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, final)
    fsync_dir(final.parent)
    if staging.parent != final.parent:
        fsync_dir(staging.parent)

