"""Staging directories of the adapter store: where adapter files are written before publication.

``<root>/.staging/<id>/`` is a private work directory; ``<id>.lock`` beside it holds a flock while the
owner process lives, so :func:`remove_stale_stagings` (the store's cleanup) removes only what a dead
process left behind. :func:`flatten_staging` brings PEFT's output to the shape a revision holds (exactly
``adapter_config.json`` and ``adapter_model.safetensors``) before :meth:`kiln.adapters.store.AdapterStore.publish`
validates it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import threading
from pathlib import Path

from kiln.adapters.errors import InvalidAdapter
from kiln.adapters.validate import CONFIG_FILE, WEIGHTS_FILE

STAGING_DIR = ".staging"
ADAPTER_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
DROPPED_FILES = frozenset({"README.md"})  # the model card PEFT writes beside the weights
MAX_STAGED_ENTRIES = 16


# Live staging dirs of this process by path, so publish() also accepts Path(staging).
_LIVE_STAGINGS: dict[str, "Staging"] = {}
_LIVE_LOCK = threading.Lock()


class Staging:
    """A private work directory inside the store, on the store's filesystem.

    Use it like a path (``os.fspath(staging)``, ``staging / "file"``) or via
    ``.path``. It stays reserved while this process lives; ``discard()`` (or
    leaving a ``with`` block without publishing) removes it.
    """

    def __init__(self, path: Path, lock_path: Path, lock_fd: int):
        self.path = path
        self._lock_path = lock_path
        self._lock_fd: int | None = lock_fd
        with _LIVE_LOCK:
            _LIVE_STAGINGS[str(path)] = self

    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other: str) -> Path:
        return self.path / other

    def __repr__(self) -> str:
        return f"Staging({str(self.path)!r})"

    @property
    def active(self) -> bool:
        return self._lock_fd is not None

    def discard(self) -> None:
        if self._lock_fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._lock_fd is None:
            return
        with _LIVE_LOCK:
            _LIVE_STAGINGS.pop(str(self.path), None)
        try:
            self._lock_path.unlink(missing_ok=True)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


def live_staging(staging: Staging | str | os.PathLike[str]) -> Staging | str | os.PathLike[str]:
    """The live :class:`Staging` of this process at ``staging``'s path (``publish`` accepts either), else it."""
    if isinstance(staging, Staging):
        return staging
    with _LIVE_LOCK:
        return _LIVE_STAGINGS.get(os.fspath(staging), staging)


def flatten_staging(staging: Path) -> None:
    """Bring PEFT output to the top level and drop PEFT's model card; reject anything else.

    ``save_pretrained`` writes into ``<dir>/<adapter name>/`` for non-default
    adapter names; a single such sub-directory is moved up.
    """
    entries = list(staging.iterdir())
    if len(entries) > MAX_STAGED_ENTRIES:
        raise InvalidAdapter(f"staging holds {len(entries)} entries; expected the PEFT files only")
    names = {e.name for e in entries}
    if CONFIG_FILE not in names:
        subdirs = [e for e in entries if e.is_dir() and not e.is_symlink()]
        if len(subdirs) == 1 and (subdirs[0] / CONFIG_FILE).is_file():
            for inner in subdirs[0].iterdir():
                if inner.name in names - {subdirs[0].name}:
                    raise InvalidAdapter(f"{inner.name} exists both at the top and in {subdirs[0].name}/")
                os.rename(inner, staging / inner.name)
            subdirs[0].rmdir()
            entries = list(staging.iterdir())
    for entry in entries:
        st = os.lstat(entry)
        if entry.name in DROPPED_FILES and stat.S_ISREG(st.st_mode):
            entry.unlink()
            continue
        if entry.name not in ADAPTER_FILES:
            raise InvalidAdapter(
                f"unexpected entry {entry.name!r} in the adapter files",
                hint=f"An adapter consists of exactly {CONFIG_FILE} and {WEIGHTS_FILE}.",
            )
        if not stat.S_ISREG(st.st_mode):
            raise InvalidAdapter(f"{entry.name} is not a regular file (links are not accepted)")


def remove_stale_stagings(staging_root: Path) -> int:
    """Remove every staging dir whose owner process is gone (its lock is free) and every entry without a
    lock file; return how many. Call under the store's lock."""
    removed = 0
    for lock_path in staging_root.glob("*.lock"):
        fd = os.open(lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            continue  # its owner is alive
        else:
            shutil.rmtree(staging_root / lock_path.stem, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    for entry in staging_root.iterdir():
        if entry.suffix != ".lock" and not (staging_root / f"{entry.name}.lock").exists():
            remove_entry(entry)
            removed += 1
    return removed


def remove_entry(path: Path) -> None:
    """Remove a file, link or directory tree (what a crash left behind)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
