"""kiln.canonical.open_regular / read_regular_file: the one reader of files Kiln did not just write.

A FIFO, directory, socket or symlink in a file's place is refused at once (never a blocking open), and
a file over the reader's limit is refused before it is read whole. Each refusal is checked on a real
file-system object of that kind.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kiln.canonical import FileTooLargeError, NotRegularFileError, open_regular, read_regular_file, sha256_file


def _returns(fn, *args, **kw):
    """Run ``fn`` on a thread; a call that blocks (the bug: a FIFO open waiting for a writer) fails the test
    instead of hanging it. The FIFO's writer side is opened afterwards to free a blocked reader."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        for a in args:
            try:
                os.close(os.open(a, os.O_WRONLY | os.O_NONBLOCK))
            except (OSError, TypeError):
                pass
        t.join(5)
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked on {args}")
    return out


def test_a_regular_file_is_read_and_the_limit_is_enforced(tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(b"x" * 100)
    assert read_regular_file(path, 100) == b"x" * 100
    with pytest.raises(FileTooLargeError, match="over the limit of 99"):
        read_regular_file(path, 99)
    fd = open_regular(path)
    try:
        assert os.get_blocking(fd) and os.read(fd, 3) == b"xxx"
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing", 10)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "socket"])
def test_anything_but_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    path = tmp_path / "kiln-receipt.json"
    (tmp_path / "target").write_bytes(b"{}")
    sock = None
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(tmp_path / "target")
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    try:
        for fn in (read_regular_file, open_regular, sha256_file):
            args = (path, 1024) if fn is read_regular_file else (path,)
            got = _returns(fn, *args)
            assert isinstance(got.get("error"), NotRegularFileError), (fn.__name__, got)
            assert ("symlink" if kind == "symlink" else "regular file") in str(got["error"]), got["error"]
    finally:
        if sock is not None:
            sock.close()


def test_a_fifo_is_refused_relative_to_a_directory_descriptor(tmp_path):
    os.mkfifo(tmp_path / "HEAD")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = _returns(lambda: read_regular_file("HEAD", 4096, dir_fd=dir_fd))
    finally:
        os.close(dir_fd)
    assert isinstance(got.get("error"), NotRegularFileError) and "FIFO" in str(got["error"])
