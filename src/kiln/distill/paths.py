"""Path safety for distillation artifacts.

Every path stored in a plan or manifest is a normalized, relative POSIX path.
Reads of artifact files walk the tree with ``openat``-style directory file
descriptors and ``O_NOFOLLOW`` on every component, so a symlink swapped into
a shard (or above a payload) is refused instead of followed.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from pathlib import Path

from kiln.canonical import FileTooLargeError, NotRegularFileError, read_regular_file
from kiln.distill.errors import PathSafetyError

__all__ = [
    "MAX_RELATIVE_PATH_CHARS",
    "MAX_PATH_COMPONENTS",
    "check_relative_path",
    "resolve_inside",
    "read_bytes_nofollow",
    "read_file_nofollow",
    "list_regular_files",
]

MAX_RELATIVE_PATH_CHARS = 512
MAX_PATH_COMPONENTS = 16

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def check_relative_path(path: object) -> str:
    """Return ``path`` unchanged if it is a safe, normalized relative POSIX path.

    Refused: non-strings, empty strings, absolute paths, backslashes, NUL or other
    control characters, ``.``/``..``/empty components, and anything whose
    ``posixpath.normpath`` differs from itself.
    """
    if not isinstance(path, str) or not path:
        raise PathSafetyError(f"path must be a non-empty string, got {path!r}")
    if len(path) > MAX_RELATIVE_PATH_CHARS:
        raise PathSafetyError(f"path longer than {MAX_RELATIVE_PATH_CHARS} characters")
    if any(ord(c) < 0x20 or c == "\x7f" for c in path):
        raise PathSafetyError(f"path {path!r} contains a control character")
    if "\\" in path:
        raise PathSafetyError(f"path {path!r} contains a backslash; use '/' separators")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise PathSafetyError(f"path {path!r} is absolute; artifact paths are relative")
    parts = path.split("/")
    if len(parts) > MAX_PATH_COMPONENTS:
        raise PathSafetyError(f"path {path!r} has more than {MAX_PATH_COMPONENTS} components")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path:
        raise PathSafetyError(f"path {path!r} is not normalized or escapes its root")
    return path


def resolve_inside(root: str | os.PathLike[str], rel: str) -> Path:
    """Join ``rel`` under ``root`` and prove, via realpath + commonpath, it stays inside.

    Also refuses when any component below ``root`` is a symlink (even one that
    points back inside), because a link can be swapped between check and use.
    """
    check_relative_path(rel)
    root_real = os.path.realpath(root)
    current = root_real
    for part in rel.split("/"):
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise PathSafetyError(f"{rel!r}: component {part!r} is a symlink")
    target = os.path.realpath(os.path.join(root_real, rel))
    if os.path.commonpath([root_real, target]) != root_real:
        raise PathSafetyError(f"{rel!r} resolves outside {root_real}")
    return Path(target)


def _open_dir_chain(root: str | os.PathLike[str], parts: list[str]) -> int:
    """Open ``root`` then each directory in ``parts`` without following symlinks."""
    if os.path.islink(root):
        raise PathSafetyError(f"{root} is a symlink; artifact roots must be real directories")
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    try:
        for part in parts:
            nxt = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as exc:
        os.close(fd)
        _raise_unsafe(exc, f"directory {part!r} under {root}")
        raise
    return fd


def _raise_unsafe(exc: OSError, what: str) -> None:
    """Turn a refused symlink (ELOOP) or a file where a directory belongs into PathSafetyError."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        raise PathSafetyError(f"{what} is a symlink or not a directory; refusing to follow it") from exc


def read_bytes_nofollow(root: str | os.PathLike[str], rel: str, *, max_bytes: int) -> bytes:
    """Read a regular file at ``root/rel`` with no symlink anywhere below ``root``.

    The size is checked with ``fstat`` on the opened descriptor before any byte is
    read, so an oversized file is refused without being loaded.
    """
    check_relative_path(rel)
    parts = rel.split("/")
    dir_fd = _open_dir_chain(root, parts[:-1])
    try:
        return read_regular_file(parts[-1], max_bytes, dir_fd=dir_fd)
    except NotRegularFileError as exc:
        raise PathSafetyError(f"{rel!r} is a symlink or not a regular file; refusing to read it") from exc
    except FileTooLargeError as exc:
        raise PathSafetyError(f"{rel!r} is over the {max_bytes}-byte limit") from exc
    except OSError as exc:
        _raise_unsafe(exc, repr(rel))
        raise
    finally:
        os.close(dir_fd)


def read_file_nofollow(path: str | os.PathLike[str], *, max_bytes: int) -> bytes:
    """:func:`read_bytes_nofollow` for one file named by an operator's path: a regular file only
    (a FIFO or device is refused at once instead of blocking), not a symlink, at most ``max_bytes``."""
    path = Path(os.path.abspath(path))
    return read_bytes_nofollow(path.parent, path.name, max_bytes=max_bytes)


def list_regular_files(root: str | os.PathLike[str], rel_dir: str, *, max_entries: int) -> list[str]:
    """Sorted names in ``root/rel_dir``; refuses symlinks and anything but regular files."""
    parts = [] if rel_dir in ("", ".") else check_relative_path(rel_dir).split("/")
    fd = _open_dir_chain(root, parts)
    try:
        names = os.listdir(fd)
        if len(names) > max_entries:
            raise PathSafetyError(f"{rel_dir!r} holds more than {max_entries} entries")
        for name in names:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise PathSafetyError(f"{rel_dir}/{name} is a symlink")
            if not stat.S_ISREG(st.st_mode):
                raise PathSafetyError(f"{rel_dir}/{name} is not a regular file")
    finally:
        os.close(fd)
    return sorted(names)
