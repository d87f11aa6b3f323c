"""Immutable model/adapter snapshot: bounded inventory, staging, verification.

Procedure (matching the launcher contract):

1. :func:`inventory` walks the model and adapter trees through directory
   descriptors, refusing links and special files, and enforces the aggregate
   bounds below.
2. :func:`stage` creates a private ``.building-*`` child beneath the already-open
   snapshot-parent descriptor, reflinks (``FICLONE``) or copies each regular file,
   and hashes source and destination for the exact inventoried length.
3. Files become 0400 and directories 0500; the whole tree is re-enumerated and
   re-hashed against the manifest.
4. The child is renamed to ``ready-*``, the parent is fsynced, and the tree is
   verified again. :func:`verify` runs once more right before spawn.

Standard library only.
"""

from __future__ import annotations

import fcntl
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from kiln.canonical import canonical_json_bytes, domain_digest
from kiln.system.private_dirs import DIR_OPEN_FLAGS, PrivateDirError, launch_token, make_private_child, remove_child
from kiln.system.provenance_io import ProvenanceError, ReadLimiter, file_identity, hash_fd_exact

SNAPSHOT_MANIFEST_DOMAIN = "kiln.teacher-snapshot-manifest.v1"  # a teacher identity field (kiln.teachers.identity)


def snapshot_manifest_digest(directories: Iterable[str], files: Iterable[tuple[str, int, str]]) -> str:
    """``snapshot_content_sha256`` over every directory and (path, size, sha256) file."""
    doc = {
        "directories": sorted(directories),
        "files": [{"path": p, "sha256": d, "size": s} for p, s, d in sorted(files)],
    }
    return domain_digest(SNAPSHOT_MANIFEST_DOMAIN, canonical_json_bytes(doc))


MAX_TREE_FILES = 100_000
MAX_TREE_DIRS = 20_000
MAX_TREE_BYTES = 4 << 40
MAX_TREE_DEPTH = 64
MAX_REL_PATH_BYTES = 4096
MAX_MANIFEST_BYTES = 64 << 20
MANIFEST_ENTRY_OVERHEAD = 96  # JSON punctuation, size and digest per entry
METADATA_HEADROOM_BYTES = 64 << 20
PER_ENTRY_HEADROOM_BYTES = 4096
INODE_HEADROOM = 1024
STAGED_FILE_MODE = 0o400
STAGED_DIR_MODE = 0o500
FICLONE = 0x40049409
FILE_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class SnapshotError(RuntimeError):
    """The model/adapter tree cannot be staged or no longer matches its manifest."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the snapshot: "model/..." or "adapter/..."
    size: int
    ident: tuple[int, int, int, int, int]


@dataclass
class Inventory:
    """Every directory and regular file of the staged trees (paths prefixed by tree name)."""

    directories: list[str] = field(default_factory=list)
    files: list[FileEntry] = field(default_factory=list)
    total_bytes: int = 0
    label_bytes: int = 0


@dataclass(frozen=True)
class Manifest:
    directories: tuple[str, ...]
    files: tuple[tuple[str, int, str], ...]  # (path, size, sha256), sorted

    @property
    def digest(self) -> str:
        return snapshot_manifest_digest(self.directories, self.files)

    def sha_of(self, path: str) -> str:
        for p, _s, d in self.files:
            if p == path:
                return d
        raise KeyError(path)


def _check_name(name: str, where: str) -> None:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SnapshotError(f"{where}/{name!r} is not valid UTF-8; rename it") from exc


def open_beneath(root_fd: int, rel: str, flags: int) -> int:
    """Open ``rel`` below ``root_fd`` one component at a time without following links."""
    parts = rel.split("/")
    fd = root_fd
    try:
        for part in parts[:-1]:
            nxt = os.open(part, DIR_OPEN_FLAGS, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        if fd != root_fd:
            os.close(fd)


def _walk(dir_fd: int, rel: str, depth: int, inv: Inventory, where: str) -> None:
    if depth > MAX_TREE_DEPTH:
        raise SnapshotError(f"{where}: deeper than {MAX_TREE_DEPTH} directory levels")
    entries = sorted(os.scandir(dir_fd), key=lambda e: e.name)
    for entry in entries:
        _check_name(entry.name, where)
        child = f"{rel}/{entry.name}"
        if len(child.encode("utf-8")) > MAX_REL_PATH_BYTES:
            raise SnapshotError(f"{where}: path {child!r} is longer than {MAX_REL_PATH_BYTES} bytes")
        inv.label_bytes += len(child.encode("utf-8")) + MANIFEST_ENTRY_OVERHEAD
        if inv.label_bytes > MAX_MANIFEST_BYTES:
            raise SnapshotError(f"{where}: manifest would exceed {MAX_MANIFEST_BYTES} bytes")
        st = os.stat(entry.name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise SnapshotError(f"{where}: {child} is a symbolic link; materialize the tree (no links allowed)")
        if stat.S_ISDIR(st.st_mode):
            inv.directories.append(child)
            if len(inv.directories) > MAX_TREE_DIRS:
                raise SnapshotError(f"{where}: more than {MAX_TREE_DIRS} directories")
            fd = os.open(entry.name, DIR_OPEN_FLAGS, dir_fd=dir_fd)
            try:
                if os.fstat(fd).st_ino != st.st_ino:
                    raise SnapshotError(f"{where}: {child} was replaced while inventorying")
                _walk(fd, child, depth + 1, inv, where)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            if st.st_nlink != 1:
                raise SnapshotError(f"{where}: {child} has {st.st_nlink} hard links; copy it to a private file")
            inv.files.append(FileEntry(child, st.st_size, file_identity(st)))
            inv.total_bytes += st.st_size
            if len(inv.files) > MAX_TREE_FILES:
                raise SnapshotError(f"{where}: more than {MAX_TREE_FILES} files")
            if inv.total_bytes > MAX_TREE_BYTES:
                raise SnapshotError(f"{where}: more than {MAX_TREE_BYTES} bytes")
        else:
            raise SnapshotError(f"{where}: {child} is a special file (device, FIFO or socket); remove it")


def inventory(trees: dict[str, Path]) -> Inventory:
    """Inventory ``{"model": path, "adapter": path}`` (adapter optional) into one bounded list."""
    inv = Inventory()
    for name, root in trees.items():
        try:
            fd = os.open(root, DIR_OPEN_FLAGS)
        except OSError as exc:
            raise SnapshotError(f"cannot open {root} as a directory without following links: {exc}") from exc
        try:
            inv.directories.append(name)
            _walk(fd, name, 1, inv, str(root))
        finally:
            os.close(fd)
    return inv


def check_capacity(parent_fd: int, inv: Inventory, what: str) -> None:
    """Free bytes and inodes for a full copy (reflinks are not assumed) plus metadata headroom."""
    vfs = os.fstatvfs(parent_fd)
    entries = len(inv.files) + len(inv.directories)
    need = inv.total_bytes + METADATA_HEADROOM_BYTES + entries * PER_ENTRY_HEADROOM_BYTES
    free = vfs.f_bavail * vfs.f_frsize
    if free < need:
        raise SnapshotError(f"{what} has {free} free bytes; the snapshot needs {need}. Free space or pick another parent")
    if vfs.f_files and vfs.f_favail < entries + INODE_HEADROOM:
        raise SnapshotError(f"{what} has {vfs.f_favail} free inodes; the snapshot needs {entries + INODE_HEADROOM}")


def _source_open(roots: dict[str, int], rel: str) -> int:
    tree, _, inner = rel.partition("/")
    return open_beneath(roots[tree], inner, FILE_OPEN_FLAGS)


def manifest_of_sources(trees: dict[str, Path], inv: Inventory, limiter: ReadLimiter) -> Manifest:
    """Hash the inventoried source files in place (dry-run and manifest-only: no snapshot)."""
    roots = {name: os.open(path, DIR_OPEN_FLAGS) for name, path in trees.items()}
    try:
        files = []
        for f in inv.files:
            fd = _source_open(roots, f.path)
            try:
                _check_same(fd, f)
                files.append((f.path, f.size, hash_fd_exact(fd, f.size, limiter, f.path)))
            finally:
                os.close(fd)
    finally:
        for fd in roots.values():
            os.close(fd)
    return Manifest(tuple(sorted(inv.directories)), tuple(sorted(files)))


def _check_same(fd: int, entry: FileEntry) -> None:
    if file_identity(os.fstat(fd)) != entry.ident:
        raise ProvenanceError(f"{entry.path}: changed between inventory and copy")


def _try_reflink(src_fd: int, dst_fd: int) -> bool:
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
    except OSError:
        return False
    return True


@dataclass
class StagedSnapshot:
    """A ``ready-*`` snapshot under an open parent descriptor (owned by the caller)."""

    parent_fd: int
    parent: Path
    name: str
    manifest: Manifest
    reflinked: int

    @property
    def path(self) -> Path:
        return self.parent / self.name

    def tree(self, name: str) -> Path:
        return self.path / name


def _copy_tree(roots: dict[str, int], build_fd: int, inv: Inventory, limiter: ReadLimiter) -> tuple[list, int]:
    for d in inv.directories:
        parent_rel, _, leaf = d.rpartition("/")
        pfd = open_beneath(build_fd, parent_rel + "/.", DIR_OPEN_FLAGS) if parent_rel else os.dup(build_fd)
        try:
            os.mkdir(leaf, 0o700, dir_fd=pfd)
        finally:
            os.close(pfd)
    files, reflinked = [], 0
    for f in inv.files:
        src = _source_open(roots, f.path)
        try:
            _check_same(src, f)
            dst = open_beneath(build_fd, f.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0))
            try:
                if _try_reflink(src, dst):
                    reflinked += 1
                    src_sha = hash_fd_exact(src, f.size, limiter, f"source {f.path}")
                else:
                    src_sha = hash_fd_exact(src, f.size, limiter, f"source {f.path}", copy_to=dst)
                os.fsync(dst)
                dst_sha = hash_fd_exact(dst, f.size, limiter, f"staged {f.path}")
                if dst_sha != src_sha:
                    raise ProvenanceError(f"{f.path}: staged copy hashes to {dst_sha}, source to {src_sha}")
                os.fchmod(dst, STAGED_FILE_MODE)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        files.append((f.path, f.size, src_sha))
    return files, reflinked


def _seal_dirs(build_fd: int, directories: list[str]) -> None:
    for d in sorted(directories, key=lambda p: p.count("/"), reverse=True):
        fd = open_beneath(build_fd, d, DIR_OPEN_FLAGS)
        try:
            os.fsync(fd)
            os.fchmod(fd, STAGED_DIR_MODE)
        finally:
            os.close(fd)


def _rehash(top_fd: int, manifest: Manifest, limiter: ReadLimiter, where: str) -> None:
    """Re-enumerate and re-hash a staged tree; modes, names, sizes and digests must all match."""
    inv = Inventory()
    for tree in sorted({d.split("/")[0] for d in manifest.directories}):
        fd = open_beneath(top_fd, tree, DIR_OPEN_FLAGS)
        try:
            inv.directories.append(tree)
            _walk(fd, tree, 1, inv, where)
        finally:
            os.close(fd)
    top_names = sorted(e.name for e in os.scandir(top_fd))
    if top_names != sorted({d.split("/")[0] for d in manifest.directories}):
        raise SnapshotError(f"{where}: unexpected top-level entries {top_names}")
    if tuple(sorted(inv.directories)) != manifest.directories:
        raise SnapshotError(f"{where}: directory set differs from the manifest")
    expected = {p: (s, d) for p, s, d in manifest.files}
    if sorted(f.path for f in inv.files) != sorted(expected):
        raise SnapshotError(f"{where}: file set differs from the manifest")
    for d in inv.directories:
        fd = open_beneath(top_fd, d, DIR_OPEN_FLAGS)
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != STAGED_DIR_MODE:
                raise SnapshotError(f"{where}: directory {d} is not mode 0500")
        finally:
            os.close(fd)
    for f in inv.files:
        size, digest = expected[f.path]
        fd = open_beneath(top_fd, f.path, FILE_OPEN_FLAGS)
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != STAGED_FILE_MODE:
                raise SnapshotError(f"{where}: file {f.path} is not mode 0400")
            if hash_fd_exact(fd, size, limiter, f"{where}/{f.path}") != digest:
                raise SnapshotError(f"{where}: {f.path} no longer matches its manifest digest")
        finally:
            os.close(fd)


def stage(
    trees: dict[str, Path], inv: Inventory, parent_fd: int, parent: Path, limiter: ReadLimiter, token: str | None = None
) -> StagedSnapshot:
    """Copy the inventoried trees into a verified ``ready-<token>`` child of ``parent_fd``.

    On any failure (an interrupting signal included) both ``.building-<token>``
    and ``ready-<token>`` are removed before the error propagates.
    """
    check_capacity(parent_fd, inv, str(parent))
    token = token or launch_token()
    building, ready = f".building-{token}", f"ready-{token}"
    roots: dict[str, int] = {}
    try:
        for name, path in trees.items():
            roots[name] = os.open(path, DIR_OPEN_FLAGS)
        make_private_child(parent_fd, building)
        build_fd = os.open(building, DIR_OPEN_FLAGS, dir_fd=parent_fd)
        try:
            files, reflinked = _copy_tree(roots, build_fd, inv, limiter)
            manifest = Manifest(tuple(sorted(inv.directories)), tuple(sorted(files)))
            _seal_dirs(build_fd, inv.directories)
            _rehash(build_fd, manifest, limiter, building)
            os.fchmod(build_fd, STAGED_DIR_MODE)
            os.fsync(build_fd)
        finally:
            os.close(build_fd)
        os.rename(building, ready, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        os.fsync(parent_fd)
        snap = StagedSnapshot(parent_fd, parent, ready, manifest, reflinked)
        verify(snap, limiter)
        return snap
    except BaseException:
        _remove_quietly(parent_fd, building)
        _remove_quietly(parent_fd, ready)
        raise
    finally:
        for fd in roots.values():
            os.close(fd)


def verify(snap: StagedSnapshot, limiter: ReadLimiter) -> None:
    """Re-hash the ready snapshot against its manifest (right before spawn, too)."""
    fd = os.open(snap.name, DIR_OPEN_FLAGS, dir_fd=snap.parent_fd)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != STAGED_DIR_MODE:
            raise SnapshotError(f"{snap.path} is not mode 0500")
        _rehash(fd, snap.manifest, limiter, str(snap.path))
    finally:
        os.close(fd)


def _remove_quietly(parent_fd: int, name: str) -> None:
    try:
        remove_child(parent_fd, name, missing_ok=True)
    except (OSError, PrivateDirError):
        # The original error matters more; stale recovery handles the remainder.
        pass
