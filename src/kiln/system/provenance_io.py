"""Rate-limited, exact-length reads for every provenance phase of the launcher.

One :class:`ReadLimiter` is created per launcher process and handed to the
snapshot copy, the snapshot verifications, the model/adapter fingerprinting and
the installed-runtime hashing, so the operator's MiB/s ceiling spans all of
them and never resets between files or phases. Standard library only.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time

from kiln.canonical import FileTooLargeError, NotRegularFileError, read_regular_file

MIN_READ_MIB_PER_SECOND = 1
MAX_READ_MIB_PER_SECOND = 16384
READ_CHUNK = 1 << 20


class ProvenanceError(RuntimeError):
    """A file changed, vanished, grew, shrank or is not a regular file while being hashed."""


class ReadLimiter:
    """Rate ceiling over every byte read since creation (``None`` = unlimited).

    Pacing: after ``n`` bytes, the next read may not start before the previous
    deadline (or now, if later) plus ``n / rate``. Idle time therefore earns no
    burst credit, and the ceiling holds across files and phases alike.
    """

    def __init__(self, mib_per_second: int | None) -> None:
        if mib_per_second is not None and (
            isinstance(mib_per_second, bool)
            or not isinstance(mib_per_second, int)
            or not MIN_READ_MIB_PER_SECOND <= mib_per_second <= MAX_READ_MIB_PER_SECOND
        ):
            raise ValueError(
                f"read ceiling must be {MIN_READ_MIB_PER_SECOND}..={MAX_READ_MIB_PER_SECOND} MiB/s, got {mib_per_second}"
            )
        self.mib_per_second = mib_per_second
        self._rate = None if mib_per_second is None else mib_per_second * 1024 * 1024
        self._next = time.monotonic()
        self.total = 0

    def consume(self, n: int) -> None:
        self.total += n
        if self._rate is None:
            return
        now = time.monotonic()
        self._next = max(self._next, now) + n / self._rate
        delay = self._next - now
        if delay > 0:
            time.sleep(delay)


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """Fields that must not change while a file is read (device, inode, size, mtime, ctime)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hash_fd_exact(fd: int, length: int, limiter: ReadLimiter, label: str, *, copy_to: int | None = None) -> str:
    """SHA-256 of exactly ``length`` bytes from ``fd`` (from offset 0), optionally copying them.

    Fails if the file is shorter or longer than ``length`` or if its metadata moves
    while it is read.
    """
    before = os.fstat(fd)
    if not stat.S_ISREG(before.st_mode):
        raise ProvenanceError(f"{label}: not a regular file")
    if before.st_size != length:
        raise ProvenanceError(f"{label}: size changed from {length} to {before.st_size} bytes")
    h = hashlib.sha256()
    offset = 0
    while offset < length:
        chunk = os.pread(fd, min(READ_CHUNK, length - offset), offset)
        if not chunk:
            raise ProvenanceError(f"{label}: truncated at {offset} of {length} bytes while reading")
        limiter.consume(len(chunk))
        h.update(chunk)
        if copy_to is not None:
            view = memoryview(chunk)
            while view:
                view = view[os.write(copy_to, view):]
        offset += len(chunk)
    if os.pread(fd, 1, length):
        raise ProvenanceError(f"{label}: grew beyond {length} bytes while reading")
    after = os.fstat(fd)
    if file_identity(after) != file_identity(before):
        raise ProvenanceError(f"{label}: modified while reading (size, mtime or ctime moved)")
    return h.hexdigest()


def read_small_file(path: str | os.PathLike[str], limit: int, limiter: ReadLimiter | None, label: str) -> bytes:
    """All bytes of a regular file of at most ``limit`` bytes (no links, FIFOs or devices:
    :func:`kiln.canonical.read_regular_file`)."""
    try:
        data = read_regular_file(path, limit)
    except NotRegularFileError:
        raise ProvenanceError(f"{label} {path} is not a regular file") from None
    except FileTooLargeError:
        raise ProvenanceError(f"{label} {path} is larger than {limit} bytes") from None
    if limiter is not None:
        limiter.consume(len(data))
    return data
