"""`dataset_path` confinement against real filesystem races: directory -> symlink swaps,
FIFOs, NUL bytes and over-long names, all in a tmp data dir."""

from __future__ import annotations

import json
import os
import threading

import pytest

from kiln.errors import KilnError
from kiln.training.core.data import load_sft_dataset, open_dataset

ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
SECRET = {"messages": [{"role": "user", "content": "secret"}, {"role": "assistant", "content": "outside"}]}


@pytest.fixture()
def dirs(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "sub").mkdir(parents=True)
    outside.mkdir()
    (data / "sub" / "d.jsonl").write_text(json.dumps(ROW) + "\n")
    (outside / "d.jsonl").write_text(json.dumps(SECRET) + "\n")
    return data, outside


def _code(fn):
    with pytest.raises(KilnError) as info:
        fn()
    return info.value.status, info.value.code


def test_reads_a_file_inside_and_hashes_the_bytes_read(dirs):
    data, _ = dirs
    examples, digest = load_sft_dataset(data, "sub/d.jsonl", max_examples=10)
    assert [m.content for m in examples[0].messages] == ["hi", "hello"]
    import hashlib

    assert digest == hashlib.sha256((data / "sub" / "d.jsonl").read_bytes()).hexdigest()
    assert load_sft_dataset(data, str(data / "sub" / "d.jsonl"), max_examples=10)[1] == digest


def test_directory_swapped_for_a_symlink_is_refused(dirs):
    data, outside = dirs
    os.rename(data / "sub", data / "sub.real")
    os.symlink(outside, data / "sub")
    assert _code(lambda: load_sft_dataset(data, "sub/d.jsonl", max_examples=10)) == (400, "dataset_symlink")


def test_directory_swapped_after_it_was_entered_still_reads_inside(dirs, monkeypatch):
    """The swap lands between walking into `sub` and opening the file (the window a
    check-then-open implementation has): the open is relative to the directory already
    entered, so it reads the inside file, never the symlink's target."""
    import kiln.training.core.data as data_mod

    data, outside = dirs
    real_open = os.open

    def swapping_open(path, flags, *args, **kw):
        if path == "d.jsonl":
            os.rename(data / "sub", data / "real")
            os.symlink(outside, data / "sub")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(data_mod.os, "open", swapping_open)
    examples, _ = load_sft_dataset(data, "sub/d.jsonl", max_examples=10)
    assert os.path.islink(data / "sub")  # the swap happened
    assert examples[0].messages[0].content == "hi"


def test_racing_directory_symlink_swaps_never_read_outside(dirs):
    """A thread keeps swapping the real `sub` directory for a symlink to `outside` and back
    while jobs read the dataset: every read is the inside file or a 4xx, never the outside one."""
    data, outside = dirs
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            os.rename(data / "sub", data / "real")
            os.symlink(outside, data / "sub")
            os.unlink(data / "sub")
            os.rename(data / "real", data / "sub")

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    seen = {"inside": 0, "refused": 0}
    try:
        for _ in range(500):
            try:
                examples, _ = load_sft_dataset(data, "sub/d.jsonl", max_examples=10)
            except KilnError as exc:
                assert exc.status in (400, 404), exc
                seen["refused"] += 1
            else:
                assert examples[0].messages[0].content == "hi", "read a file outside the data dir"
                seen["inside"] += 1
    finally:
        stop.set()
        t.join(10)
    assert sum(seen.values()) == 500


def test_fifo_is_refused_without_blocking(dirs):
    data, _ = dirs
    os.mkfifo(data / "sub" / "pipe.jsonl")
    result: list = []
    t = threading.Thread(target=lambda: result.append(_code(lambda: open_dataset(data, "sub/pipe.jsonl"))),
                         daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "opening a FIFO blocked the thread"
    assert result == [(400, "dataset_not_file")]


def test_file_swapped_for_a_fifo_is_refused(dirs):
    data, _ = dirs
    os.unlink(data / "sub" / "d.jsonl")
    os.mkfifo(data / "sub" / "d.jsonl")
    assert _code(lambda: load_sft_dataset(data, "sub/d.jsonl", max_examples=10)) == (400, "dataset_not_file")


@pytest.mark.parametrize("path, code", [
    ("sub/d\x00.jsonl", "invalid_dataset_path"),
    ("x" * 300 + ".jsonl", "invalid_dataset_path"),
    ("sub/" + "y" * 300 + "/d.jsonl", "invalid_dataset_path"),
    ("../outside/d.jsonl", "dataset_outside_data_dir"),
    ("sub/../../outside/d.jsonl", "dataset_outside_data_dir"),
    ("/etc/passwd", "dataset_outside_data_dir"),
    ("sub", "dataset_not_file"),
    ("sub/d.jsonl/x", "dataset_not_file"),
    ("nope/d.jsonl", "dataset_not_found"),
])
def test_bad_paths_are_4xx(dirs, path, code):
    data, _ = dirs
    status, got = _code(lambda: load_sft_dataset(data, path, max_examples=10))
    assert got == code and status == (404 if code == "dataset_not_found" else 400)


def test_symlinked_file_is_refused(dirs):
    data, outside = dirs
    os.symlink(outside / "d.jsonl", data / "link.jsonl")
    assert _code(lambda: load_sft_dataset(data, "link.jsonl", max_examples=10)) == (400, "dataset_symlink")


def test_hard_link_to_a_file_outside_is_refused(dirs):
    """A hard link inside the data directory names the outside file itself (no symlink to see):
    files with more than one link are refused; the outside content is never read."""
    data, outside = dirs
    os.link(outside / "d.jsonl", data / "linked.jsonl")
    assert _code(lambda: load_sft_dataset(data, "linked.jsonl", max_examples=10)) == (400, "dataset_hard_link")
    os.unlink(outside / "d.jsonl")  # the data dir's name is now the file's only link: an ordinary file
    examples, _ = load_sft_dataset(data, "linked.jsonl", max_examples=10)
    assert examples[0].messages[0].content == "secret"
