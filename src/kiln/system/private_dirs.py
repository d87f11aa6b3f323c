"""Private parent directories of the launcher: checks, anchored removal, stale recovery.

The snapshot parent and the runtime-cache parent must be owned by the launcher
UID with mode 0700, and every ancestor must be owned by that UID or root (or the
kernel overflow UID under a validated single-entry rootless user namespace) and
must not let others rename entries (group/other-writable only with the sticky
bit). Children are created and removed only through an open descriptor of the
parent; removal never follows links and never crosses filesystems.
Standard library only.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

PRIVATE_MODE = 0o700
DIR_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
STALE_CHILD_RE = re.compile(r"^(?:\.building|ready|cache)-(?P<pid>[0-9]{1,10})-[0-9a-f]{16}$")
UID_MAP_PATH = "/proc/self/uid_map"
OVERFLOW_UID_PATH = "/proc/sys/kernel/overflowuid"


class PrivateDirError(RuntimeError):
    """A private parent, its ancestry or one of its children is unsafe or unusable."""


def _overflow_uid_allowed() -> int | None:
    """The overflow UID when this process runs under a single-entry rootless user namespace."""
    try:
        with open(UID_MAP_PATH, encoding="ascii") as f:
            lines = [ln.split() for ln in f.read(4096).splitlines() if ln.strip()]
        with open(OVERFLOW_UID_PATH, encoding="ascii") as f:
            overflow = int(f.read(64).strip())
    except (OSError, ValueError):
        return None
    if len(lines) != 1 or len(lines[0]) != 3:
        return None
    inside, _outside, count = (int(x) for x in lines[0])
    if count != 1 or inside != os.geteuid():
        return None
    return overflow


def check_ancestry(path: Path) -> None:
    """Refuse an ancestor chain that another user could rename or replace."""
    uid = os.geteuid()
    overflow = _overflow_uid_allowed()
    trusted = {uid, 0} | ({overflow} if overflow is not None else set())
    for ancestor in [path, *path.parents]:
        st = os.lstat(ancestor)
        if stat.S_ISLNK(st.st_mode):
            raise PrivateDirError(f"{ancestor} is a symbolic link; pass the resolved path")
        if st.st_uid not in trusted:
            raise PrivateDirError(
                f"{ancestor} is owned by uid {st.st_uid}; every ancestor of {path} must be owned by uid {uid} or root"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise PrivateDirError(
                f"{ancestor} is group/other-writable without the sticky bit, so others could rename {path}; "
                "use a directory under a safe ancestry"
            )


def open_private_parent(path: Path, *, create: bool) -> int:
    """Open (creating with mode 0700 if allowed) a private parent and return its descriptor."""
    path = Path(os.path.abspath(path))
    if create and not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, PRIVATE_MODE)
        except FileExistsError:
            pass
    real = Path(os.path.realpath(path))
    if real != path:
        raise PrivateDirError(f"{path} resolves to {real} through a symbolic link; pass the resolved path")
    try:
        fd = os.open(path, DIR_OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise PrivateDirError(f"{path} does not exist; create it with mode 0700") from exc
    except NotADirectoryError as exc:
        raise PrivateDirError(f"{path} is not a directory") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PrivateDirError(f"{path} is owned by uid {st.st_uid}, not the launcher uid {os.geteuid()}")
        if stat.S_IMODE(st.st_mode) != PRIVATE_MODE:
            raise PrivateDirError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (chmod 700 {path})")
        check_ancestry(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def launch_token() -> str:
    """``<pid>-<16 hex nonce>``; children are named ``<kind>-<token>``.

    The pid lets stale recovery tell owned from abandoned entries. The launcher
    draws the token before creating anything, so it knows every name it may
    have to remove even if it is interrupted between a ``mkdir`` and its return.
    """
    return f"{os.getpid()}-{secrets.token_hex(8)}"


def make_private_child(parent_fd: int, name: str) -> None:
    os.mkdir(name, PRIVATE_MODE, dir_fd=parent_fd)


def remove_child(parent_fd: int, name: str, *, missing_ok: bool = False) -> None:
    """Remove ``name`` under ``parent_fd`` recursively, never following links or crossing filesystems."""
    dev = os.fstat(parent_fd).st_dev
    try:
        _remove_at(parent_fd, name, dev)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return
    os.fsync(parent_fd)


def _remove_at(parent_fd: int, name: str, dev: int) -> None:
    st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if st.st_dev != dev:
        raise PrivateDirError(f"{name} is on another filesystem (a mount point); not removing it")
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    fd = os.open(name, DIR_OPEN_FLAGS, dir_fd=parent_fd)
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            raise PrivateDirError(f"{name} was replaced during removal")
        os.fchmod(fd, PRIVATE_MODE)
        for entry in list(os.scandir(fd)):
            _remove_at(fd, entry.name, dev)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class StaleReport:
    removed: list[str]
    kept_owned: list[str]


def recover_stale(parent: Path) -> StaleReport:
    """Remove ``.building-*``, ``ready-*`` and ``cache-*`` children whose launcher pid is gone.

    Entries whose pid still runs are kept (a live launcher, or a reused pid: in doubt,
    keep). Other names are never touched.
    """
    fd = open_private_parent(Path(parent), create=False)
    removed, kept = [], []
    try:
        for entry in sorted(os.scandir(fd), key=lambda e: e.name):
            m = STALE_CHILD_RE.fullmatch(entry.name)
            if not m:
                continue
            if _pid_alive(int(m.group("pid"))):
                kept.append(entry.name)
                continue
            remove_child(fd, entry.name)
            removed.append(entry.name)
    finally:
        os.close(fd)
    return StaleReport(removed=removed, kept_owned=kept)
