"""Adapter archives (tar.gz): deterministic packing and defensive unpacking.

Unpacking treats the archive as hostile. One streaming parser (:class:`_TarStream`)
reads the gzip stream header by header, and the same parser extracts: there is
no separate scanner that could read the archive differently from the extractor
(a pax ``size`` or ``path`` record applies to both, because there is only one).
Caps are enforced as the stream is read, before any data is buffered or written:

* at most ``MAX_ARCHIVE_MEMBERS`` headers, pax and GNU long-name headers included;
* pax / long-name headers of at most ``MAX_META_HEADER_BYTES``;
* member names of at most ``MAX_MEMBER_NAME_BYTES``;
* a per-file size cap (``adapter_config.json``, the weights, ignored files) and a
  cap on the total declared bytes, checked against each header's declared size;
* decompression stops at the end-of-archive marker, so the gzip layer never
  expands more than the headers and capped data.

Only regular files with the expected adapter names are written, optionally from
inside one top-level folder; ignored files (``kiln-manifest.json``,
``kiln-receipt.json``, ``README.md``: a download carries them) are skipped
without being written. Links, devices, FIFOs, sparse files, absolute paths and
``..`` are refused. Error messages never echo more than a
short prefix of a member name.
"""

from __future__ import annotations

import gzip
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterator

from kiln.adapters.errors import AdapterTooLarge, UnsafeArchive
from kiln.adapters.manifest import MANIFEST_FILE, MAX_LORA_RANK, shorten
from kiln.adapters.receipt import RECEIPT_FILE
from kiln.adapters.validate import CONFIG_FILE, MAX_ADAPTER_CONFIG_BYTES, MAX_ADAPTER_WEIGHTS_BYTES, WEIGHTS_FILE

MAX_ARCHIVE_MEMBERS = 16  # headers, pax / long-name headers included
MAX_META_HEADER_BYTES = 8 * 1024  # one pax / GNU long-name header
MAX_MEMBER_NAME_BYTES = 256
MAX_IGNORED_FILE_BYTES = 1024 * 1024  # kiln-manifest.json, kiln-receipt.json, README.md: skipped, never written
EXTRACTED_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
IGNORED_FILES = frozenset({MANIFEST_FILE, RECEIPT_FILE, "README.md"})  # accepted in uploads but not kept
SAFETENSORS_HEADER_ALLOWANCE = 64 * 1024  # fixed part of a safetensors JSON header
SAFETENSORS_BYTES_PER_TENSOR = 256  # dtype, shape and offsets of one header entry, beyond its name
_WIDEST_DTYPE_BYTES = 8  # F64
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_COPY_CHUNK = 1 << 20
_POSIX_MAGIC = b"ustar\x00"
_FILE_TYPES = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE}


def pack(src_dir: Path, dest: Path, *, folder: str) -> None:
    """Write ``src_dir``'s regular files as ``folder/<file>`` into a reproducible tar.gz."""
    with open(dest, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for path in sorted(src_dir.iterdir()):
                info = tarfile.TarInfo(f"{folder}/{path.name}")
                info.size = path.stat().st_size
                info.mode = 0o644
                info.mtime = 0
                with open(path, "rb") as f:
                    tar.addfile(info, f)


def max_weights_bytes(base_shapes: dict[str, tuple[int, ...]], max_rank: int = MAX_LORA_RANK) -> int:
    """The largest ``adapter_model.safetensors`` a LoRA of this base can be.

    Every 2-D ``.weight`` of the base adapted at ``max_rank`` in the widest float
    dtype: ``A [r, in]`` and ``B [out, r]``, plus their safetensors header entries.
    """
    total = SAFETENSORS_HEADER_ALLOWANCE
    for key, shape in base_shapes.items():
        if key.endswith(".weight") and len(shape) == 2:
            fan_out, fan_in = shape
            total += max_rank * (fan_in + fan_out) * _WIDEST_DTYPE_BYTES
            total += 2 * (len(key) + 32 + SAFETENSORS_BYTES_PER_TENSOR)
    return min(total, MAX_ADAPTER_WEIGHTS_BYTES)


@dataclass
class _Member:
    name: str
    kind: bytes
    size: int

    def isdir(self) -> bool:
        return self.kind == tarfile.DIRTYPE


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    parts, remaining = [], n
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            break
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def _parse_pax(data: bytes) -> dict[str, str]:
    """Pax extended-header records: ``"<len> <key>=<value>\\n"``."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos:pos + 1] != b"\x00":
        space = data.find(b" ", pos, pos + 12)
        length_text = data[pos:space] if space > pos else b""
        if not length_text.isdigit():
            raise UnsafeArchive("malformed pax header record")
        end = pos + int(length_text)
        record = data[space + 1:end]
        if end > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise UnsafeArchive("malformed pax header record")
        key, _, value = record[:-1].partition(b"=")
        try:
            records[key.decode("utf-8")] = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UnsafeArchive("pax header record is not UTF-8") from exc
        pos = end
    return records


def _header_name(block: bytes) -> str:
    name = block[0:100].split(b"\x00", 1)[0]
    if block[257:263] == _POSIX_MAGIC:
        prefix = block[345:500].split(b"\x00", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return _decode_name(name)


def _decode_name(raw: bytes) -> str:
    if len(raw) > MAX_MEMBER_NAME_BYTES:
        raise UnsafeArchive(f"member name of {len(raw)} bytes exceeds {MAX_MEMBER_NAME_BYTES}: {shorten(raw)}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeArchive(f"member name {shorten(raw)} is not UTF-8") from exc


class _TarStream:
    """The one tar parser: walks headers from a (decompressing) stream with every cap applied.

    Iterating yields members; the caller then either :meth:`copy_to` a file or
    lets the next iteration skip the data (read and dropped, never written).
    """

    def __init__(self, stream: BinaryIO, *, max_members: int, max_total_bytes: int):
        self._stream = stream
        self._max_members = max_members
        self._max_total = max_total_bytes
        self._headers = 0
        self._declared = 0
        self._unread = 0  # data + padding of the current member not consumed yet
        self._uncharged = 0  # declared size of the current member, before its data is consumed

    def admit(self) -> None:
        """Count the current member's declared size against the total before reading its data."""
        self._declared += self._uncharged
        self._uncharged = 0
        if self._declared > self._max_total:
            raise AdapterTooLarge(f"archive members add up to more than {self._max_total} bytes")

    def _read_block(self, n_bytes: int) -> bytes:
        padded = -(-n_bytes // _BLOCK) * _BLOCK
        data = _read_exact(self._stream, padded)
        if len(data) != padded:
            raise UnsafeArchive("archive is truncated")
        return data[:n_bytes]

    def _skip_unread(self) -> None:
        self.admit()
        while self._unread:
            chunk = self._stream.read(min(_COPY_CHUNK, self._unread))
            if not chunk:
                raise UnsafeArchive("archive is truncated")
            self._unread -= len(chunk)

    def _next_header(self) -> tuple[bytes, int, bytes] | None:
        block = _read_exact(self._stream, _BLOCK)
        if not block or block == _ZERO_BLOCK:
            return None  # end of archive: nothing after it is decompressed
        if len(block) != _BLOCK:
            raise UnsafeArchive("archive is truncated")
        self._headers += 1
        if self._headers > self._max_members:
            raise UnsafeArchive(f"archive has more than {self._max_members} members")
        try:
            stored = tarfile.nti(block[148:156])
            size = tarfile.nti(block[124:136])
        except tarfile.InvalidHeaderError as exc:
            raise UnsafeArchive("corrupt tar header") from exc
        if stored not in tarfile.calc_chksums(block):
            raise UnsafeArchive("tar header checksum mismatch (not a tar archive, or corrupt)")
        if size < 0:
            raise UnsafeArchive("negative member size")
        return block, size, block[156:157]

    def __iter__(self) -> Iterator[_Member]:
        pax: dict[str, str] = {}
        long_name: str | None = None
        while True:
            self._skip_unread()
            header = self._next_header()
            if header is None:
                return
            block, size, kind = header
            if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME):
                if size > MAX_META_HEADER_BYTES:
                    raise UnsafeArchive(f"tar metadata header of {size} bytes exceeds {MAX_META_HEADER_BYTES}")
                data = self._read_block(size)
                if kind == tarfile.GNUTYPE_LONGNAME:
                    long_name = _decode_name(data.split(b"\x00", 1)[0])
                    continue
                records = _parse_pax(data)
                if any(k.startswith("GNU.sparse") for k in records):
                    raise UnsafeArchive("sparse members are not accepted")
                if kind == tarfile.XGLTYPE:
                    if {"path", "size", "linkpath"} & set(records):
                        raise UnsafeArchive("global pax headers may not set path, size or linkpath")
                    continue
                pax.update(records)
                continue
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.GNUTYPE_LONGLINK):
                raise UnsafeArchive("archive contains a link; only regular files are accepted")
            if kind not in _FILE_TYPES and kind != tarfile.DIRTYPE:
                raise UnsafeArchive(f"archive contains a special member (type {kind!r}); only regular files are accepted")
            if "path" in pax:
                name = _decode_name(pax["path"].encode("utf-8"))
            else:
                name = long_name if long_name is not None else _header_name(block)
            if "size" in pax:
                text = pax["size"]
                if not (text.isascii() and text.isdigit() and len(text) <= 20):
                    raise UnsafeArchive("malformed pax size record")
                size = int(text)
            if kind == tarfile.AREGTYPE and name.endswith("/"):
                kind = tarfile.DIRTYPE  # old V7 directories
            if kind == tarfile.DIRTYPE and size:
                raise UnsafeArchive(f"directory member {shorten(name)} has data")
            pax, long_name = {}, None
            self._uncharged = size
            self._unread = -(-size // _BLOCK) * _BLOCK
            yield _Member(name, kind, size)

    def copy_to(self, member: _Member, out: BinaryIO) -> None:
        self.admit()
        remaining = member.size
        while remaining:
            chunk = self._stream.read(min(_COPY_CHUNK, remaining))
            if not chunk:
                raise UnsafeArchive(f"{shorten(member.name)} is truncated")
            out.write(chunk)
            remaining -= len(chunk)
            self._unread -= len(chunk)


def _member_file_name(member: _Member, folders: set[str | None]) -> str | None:
    """The adapter file a member maps to (None for the optional top-level folder itself)."""
    name = member.name
    if not name or "\\" in name or "\x00" in name or name.startswith("/"):
        raise UnsafeArchive(f"unsafe member path {shorten(name)}")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if not parts and member.isdir():
        return None  # "./", as written by `tar -C dir .`
    if not parts or ".." in parts or len(parts) > 2 or (member.isdir() and len(parts) != 1):
        raise UnsafeArchive(f"unsafe member path {shorten(name)}")
    folders.add(parts[0] if len(parts) == 2 or member.isdir() else None)
    if len(folders) > 1:
        raise UnsafeArchive("archive members must sit at the top level or inside one folder")
    return None if member.isdir() else parts[-1]


def _file_limit(fname: str, member: _Member, max_weights: int) -> int:
    if fname in IGNORED_FILES:
        return MAX_IGNORED_FILE_BYTES
    if fname == CONFIG_FILE:
        return MAX_ADAPTER_CONFIG_BYTES
    if fname == WEIGHTS_FILE:
        return max_weights
    raise UnsafeArchive(
        f"unexpected file {shorten(member.name)} in the archive",
        hint=f"An adapter archive holds {CONFIG_FILE} and {WEIGHTS_FILE} (plus optionally {MANIFEST_FILE}).",
    )


def unpack(
    archive: Path,
    dest: Path,
    *,
    max_weights: int = MAX_ADAPTER_WEIGHTS_BYTES,
    max_members: int = MAX_ARCHIVE_MEMBERS,
    max_bytes: int | None = None,
) -> list[str]:
    """Extract the adapter files of ``archive`` (tar.gz) flat into ``dest``; returns their names.

    ``max_weights`` caps ``adapter_model.safetensors`` (see :func:`max_weights_bytes`);
    ``max_bytes`` caps the members' total (default: what the allowed files can add up to).
    """
    if max_bytes is None:
        max_bytes = max_weights + MAX_ADAPTER_CONFIG_BYTES + len(IGNORED_FILES) * MAX_IGNORED_FILE_BYTES
    written: list[str] = []
    seen: set[str] = set()
    folders: set[str | None] = set()
    try:
        with gzip.open(archive, "rb") as gz:
            tar = _TarStream(gz, max_members=max_members, max_total_bytes=max_bytes)  # type: ignore[arg-type]
            for member in tar:
                fname = _member_file_name(member, folders)
                if fname is None:
                    continue
                limit = _file_limit(fname, member, max_weights)
                if member.size > limit:
                    raise AdapterTooLarge(f"{fname} in the archive is {member.size} bytes; the limit is {limit}")
                if fname in seen:
                    raise UnsafeArchive(f"{fname} appears twice in the archive")
                seen.add(fname)
                if fname in IGNORED_FILES:
                    continue  # skipped by the next iteration: read, never written
                tar.admit()  # the total cap, before a file is created
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                with os.fdopen(os.open(dest / fname, flags, 0o644), "wb") as out:
                    tar.copy_to(member, out)
                written.append(fname)
    except (OSError, EOFError, zlib.error) as exc:
        raise UnsafeArchive(f"not a valid gzip stream: {shorten(str(exc), 120)}") from exc
    missing = EXTRACTED_FILES - set(written)
    if missing:
        raise UnsafeArchive(f"archive lacks {', '.join(sorted(missing))}")
    return sorted(written)
