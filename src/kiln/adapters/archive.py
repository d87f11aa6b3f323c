"""Adapter archives (tar.gz): deterministic packing and defensive unpacking.

Unpacking treats the archive as hostile. It is decompressed to disk under a byte
cap, every raw header is scanned (member count, metadata header size, member
type) before ``tarfile`` parses anything, and only regular files with the
expected adapter names are written, optionally from inside one top-level folder.
Links, devices, FIFOs, absolute paths and ``..`` are refused.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path, PurePosixPath

from kiln.adapters.errors import AdapterTooLarge, UnsafeArchive
from kiln.adapters.manifest import MANIFEST_FILE
from kiln.adapters.validate import CONFIG_FILE, WEIGHTS_FILE

MAX_ARCHIVE_MEMBERS = 16
MAX_UNPACKED_BYTES = 8 * 1024**3
MAX_META_HEADER_BYTES = 64 * 1024  # pax / GNU long-name headers (tarfile reads these into memory)
EXTRACTED_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
IGNORED_FILES = frozenset({MANIFEST_FILE, "README.md"})  # accepted in uploads but not kept
_BLOCK = 512
_COPY_CHUNK = 1 << 20
_META_TYPES = {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK}
_FILE_TYPES = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE}


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


def _gunzip(src: Path, dest: Path, max_bytes: int) -> None:
    total = 0
    try:
        with gzip.open(src, "rb") as gz, open(dest, "wb") as out:
            while chunk := gz.read(_COPY_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise AdapterTooLarge(f"archive unpacks to more than {max_bytes} bytes")
                out.write(chunk)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise UnsafeArchive(f"not a valid gzip stream: {exc}") from exc


def _scan_headers(tar_path: Path, max_members: int) -> None:
    """Walk the raw 512-byte headers: bound counts and metadata sizes, refuse odd member types."""
    members = 0
    with open(tar_path, "rb") as f:
        pos = 0
        while True:
            f.seek(pos)
            block = f.read(_BLOCK)
            if len(block) < _BLOCK or block == bytes(_BLOCK):
                return
            members += 1
            if members > max_members:
                raise UnsafeArchive(f"archive has more than {max_members} members")
            try:
                size = tarfile.nti(block[124:136])
            except tarfile.InvalidHeaderError as exc:
                raise UnsafeArchive(f"corrupt tar header at byte {pos}") from exc
            kind = block[156:157]
            if kind in _META_TYPES:
                if size > MAX_META_HEADER_BYTES:
                    raise UnsafeArchive(f"tar metadata header of {size} bytes exceeds {MAX_META_HEADER_BYTES}")
            elif kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                raise UnsafeArchive("archive contains a link; only regular files are accepted")
            elif kind not in _FILE_TYPES:
                raise UnsafeArchive(f"archive contains a special member (type {kind!r}); only regular files are accepted")
            if size < 0:
                raise UnsafeArchive("negative member size")
            pos += _BLOCK + -(-size // _BLOCK) * _BLOCK


def _member_file_name(member: tarfile.TarInfo, folders: set[str | None]) -> str | None:
    """The adapter file a member maps to (None for the optional top-level folder itself)."""
    name = member.name
    if not name or "\\" in name or "\x00" in name or name.startswith("/"):
        raise UnsafeArchive(f"unsafe member path {name!r}")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if not parts and member.isdir():
        return None  # "./", as written by `tar -C dir .`
    if not parts or ".." in parts or len(parts) > 2 or (member.isdir() and len(parts) != 1):
        raise UnsafeArchive(f"unsafe member path {name!r}")
    folders.add(parts[0] if len(parts) == 2 or member.isdir() else None)
    if len(folders) > 1:
        raise UnsafeArchive("archive members must sit at the top level or inside one folder")
    if member.isdir():
        return None
    if not member.isreg():
        raise UnsafeArchive(f"member {name!r} is not a regular file")
    return parts[-1]


def unpack(
    archive: Path,
    dest: Path,
    *,
    scratch: Path,
    max_members: int = MAX_ARCHIVE_MEMBERS,
    max_bytes: int = MAX_UNPACKED_BYTES,
) -> list[str]:
    """Extract the adapter files of ``archive`` (tar.gz) flat into ``dest``; returns their names.

    ``scratch`` holds the decompressed tar while it is checked.
    """
    tar_path = scratch / "upload.tar"
    written: list[str] = []
    total = 0
    folders: set[str | None] = set()
    try:
        _gunzip(archive, tar_path, max_bytes)
        _scan_headers(tar_path, max_members)
        with tarfile.open(tar_path, mode="r:") as tar:
            for member in tar:
                fname = _member_file_name(member, folders)
                if fname is None:
                    continue
                total += member.size
                if total > max_bytes:
                    raise AdapterTooLarge(f"archive members add up to more than {max_bytes} bytes")
                if fname in IGNORED_FILES:
                    continue
                if fname not in EXTRACTED_FILES:
                    raise UnsafeArchive(
                        f"unexpected file {member.name!r} in the archive",
                        hint=f"An adapter archive holds {CONFIG_FILE} and {WEIGHTS_FILE} (plus optionally "
                        f"{MANIFEST_FILE}).",
                    )
                if fname in written:
                    raise UnsafeArchive(f"{fname} appears twice in the archive")
                src = tar.extractfile(member)
                assert src is not None  # regular file
                fd = os.open(dest / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
                with src, os.fdopen(fd, "wb") as out:
                    remaining = member.size
                    while remaining:
                        chunk = src.read(min(_COPY_CHUNK, remaining))
                        if not chunk:
                            raise UnsafeArchive(f"{member.name} is truncated")
                        out.write(chunk)
                        remaining -= len(chunk)
                written.append(fname)
    except tarfile.TarError as exc:
        raise UnsafeArchive(f"not a valid tar archive: {exc}") from exc
    finally:
        tar_path.unlink(missing_ok=True)
    missing = EXTRACTED_FILES - set(written)
    if missing:
        raise UnsafeArchive(f"archive lacks {', '.join(sorted(missing))}")
    return sorted(written)

