"""Snapshot staging, verification, private parents, anchored removal and stale recovery."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.teachers.conftest import build_tiny_adapter, private_dir
from kiln.system import private_dirs, snapshot
from kiln.teachers.identity import snapshot_manifest_digest
from kiln.system.provenance_io import ProvenanceError, ReadLimiter
from kiln.system.snapshot import SnapshotError


def _stage(trees, parent: Path, limiter=None):
    fd = private_dirs.open_private_parent(parent, create=False)
    inv = snapshot.inventory(trees)
    return fd, snapshot.stage(trees, inv, fd, parent, limiter or ReadLimiter(None))


def test_stage_copies_seals_and_matches_source_manifest(tiny_model, tmp_path, roots):
    adapter = build_tiny_adapter(tmp_path / "adapters" / "a")
    trees = {"model": tiny_model, "adapter": adapter}
    fd, snap = _stage(trees, roots["snapshot"])
    try:
        assert snap.name.startswith("ready-") and os.listdir(roots["snapshot"]) == [snap.name]
        staged = snap.path
        assert stat.S_IMODE(os.stat(staged).st_mode) == 0o500
        for dirpath, dirs, files in os.walk(staged):
            for d in dirs:
                assert stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode) == 0o500
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode) == 0o400
        assert (staged / "model" / "extra" / "notes.txt").read_bytes() == (tiny_model / "extra" / "notes.txt").read_bytes()
        # The staged manifest equals the one hashed in place from the source (dry-run path).
        src = snapshot.manifest_of_sources(trees, snapshot.inventory(trees), ReadLimiter(None))
        assert src == snap.manifest
        assert "model/extra" in snap.manifest.directories and "adapter" in snap.manifest.directories
        files = [(p, s, d) for p, s, d in snap.manifest.files]
        assert snap.manifest.digest == snapshot_manifest_digest(snap.manifest.directories, files)
        snapshot.verify(snap, ReadLimiter(None))
        # Source may change after a successful copy without touching the snapshot.
        (tiny_model / "extra" / "notes.txt").write_text("changed")
        snapshot.verify(snap, ReadLimiter(None))
    finally:
        private_dirs.remove_child(fd, snap.name)
        os.close(fd)
    assert os.listdir(roots["snapshot"]) == []


def test_mutation_during_copy_fails_and_leaves_nothing(tmp_path, roots):
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(os.urandom(3 << 20))

    class MutateMidCopy(ReadLimiter):
        """Appends to the weights once 1 MiB of them has been read: a writer racing the copy,
        at a point fixed by the bytes read rather than by a sleep."""

        mutated = False

        def consume(self, n: int) -> None:
            super().consume(n)
            if not self.mutated and self.total > 1 << 20:
                self.mutated = True
                with open(model / "model.safetensors", "ab") as f:
                    f.write(b"x")

    limiter = MutateMidCopy(None)
    with pytest.raises(ProvenanceError, match="model.safetensors"):
        _stage({"model": model}, roots["snapshot"], limiter)
    assert limiter.mutated
    assert os.listdir(roots["snapshot"]) == []


def test_change_between_inventory_and_copy_fails(tiny_model, roots):
    trees = {"model": tiny_model}
    fd = private_dirs.open_private_parent(roots["snapshot"], create=False)
    try:
        inv = snapshot.inventory(trees)
        (tiny_model / "config.json").write_text('{"vocab_size": 1}')
        with pytest.raises(ProvenanceError, match="changed"):
            snapshot.stage(trees, inv, fd, roots["snapshot"], ReadLimiter(None))
    finally:
        os.close(fd)
    assert os.listdir(roots["snapshot"]) == []


def test_verification_catches_staged_mutation(tiny_model, roots):
    fd, snap = _stage({"model": tiny_model}, roots["snapshot"])
    try:
        target = snap.path / "model" / "config.json"
        os.chmod(target, 0o600)
        target.write_text('{"vocab_size": 999}')
        os.chmod(target, 0o400)
        with pytest.raises((SnapshotError, ProvenanceError)):
            snapshot.verify(snap, ReadLimiter(None))
        os.chmod(snap.path / "model", 0o700)
        (snap.path / "model" / "intruder.py").write_text("x")
        os.chmod(snap.path / "model", 0o500)
        with pytest.raises(SnapshotError, match="file set|differs|mode"):
            snapshot.verify(snap, ReadLimiter(None))
    finally:
        private_dirs.remove_child(fd, snap.name)
        os.close(fd)


def test_symlink_anywhere_is_refused(tiny_model, tmp_path):
    os.symlink(tiny_model / "config.json", tiny_model / "extra" / "link.json")
    with pytest.raises(SnapshotError, match="symbolic link"):
        snapshot.inventory({"model": tiny_model})


def test_special_file_is_refused(tiny_model):
    os.mkfifo(tiny_model / "extra" / "pipe")
    with pytest.raises(SnapshotError, match="special file"):
        snapshot.inventory({"model": tiny_model})


def test_hard_link_is_refused(tiny_model):
    os.link(tiny_model / "config.json", tiny_model / "extra" / "config-copy.json")
    with pytest.raises(SnapshotError, match="hard links"):
        snapshot.inventory({"model": tiny_model})


def test_inventory_bounds(tiny_model, monkeypatch):
    monkeypatch.setattr(snapshot, "MAX_TREE_FILES", 2)
    with pytest.raises(SnapshotError, match="more than 2 files"):
        snapshot.inventory({"model": tiny_model})
    monkeypatch.setattr(snapshot, "MAX_TREE_FILES", 100)
    monkeypatch.setattr(snapshot, "MAX_TREE_DEPTH", 1)
    (tiny_model / "extra" / "deeper").mkdir()
    with pytest.raises(SnapshotError, match="deeper than 1"):
        snapshot.inventory({"model": tiny_model})


def test_capacity_check_refuses_when_space_is_short(tiny_model, roots, monkeypatch):
    inv = snapshot.inventory({"model": tiny_model})
    fd = private_dirs.open_private_parent(roots["snapshot"], create=False)
    try:
        snapshot.check_capacity(fd, inv, "snapshots")
        inv.total_bytes = 1 << 60
        with pytest.raises(SnapshotError, match="free bytes"):
            snapshot.check_capacity(fd, inv, "snapshots")
    finally:
        os.close(fd)


# ------------------------------------------------------------ private parents


def test_private_parent_wrong_mode(tmp_path):
    p = tmp_path / "loose"
    p.mkdir()
    os.chmod(p, 0o755)
    with pytest.raises(private_dirs.PrivateDirError, match="0700"):
        private_dirs.open_private_parent(p, create=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_private_parent_wrong_owner(tmp_path):
    p = private_dir(tmp_path / "foreign")
    os.chown(p, 12345, 12345)
    with pytest.raises(private_dirs.PrivateDirError, match="owned by uid 12345"):
        private_dirs.open_private_parent(p, create=False)


def test_unsafe_ancestry_writable_without_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    p = private_dir(shared / "snaps")
    with pytest.raises(private_dirs.PrivateDirError, match="sticky"):
        private_dirs.open_private_parent(p, create=False)
    os.chmod(shared, 0o1777)  # sticky shared directory like /tmp is fine
    os.close(private_dirs.open_private_parent(p, create=False))


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_unsafe_ancestry_foreign_owner(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    p = private_dir(other / "snaps")
    os.chown(other, 23456, 23456)
    with pytest.raises(private_dirs.PrivateDirError, match="owned by uid 23456"):
        private_dirs.open_private_parent(p, create=False)


def test_symlinked_parent_refused(tmp_path):
    real = private_dir(tmp_path / "real")
    os.symlink(real, tmp_path / "alias")
    with pytest.raises(private_dirs.PrivateDirError, match="symbolic link"):
        private_dirs.open_private_parent(tmp_path / "alias", create=False)


def test_parent_created_private_when_missing(tmp_path):
    fd = private_dirs.open_private_parent(tmp_path / "a" / "b", create=True)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == 0o700


def test_removal_does_not_follow_links(tmp_path, roots):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    fd = private_dirs.open_private_parent(roots["snapshot"], create=False)
    try:
        name = f"ready-{private_dirs.launch_token()}"
        private_dirs.make_private_child(fd, name)
        os.symlink(victim, roots["snapshot"] / name / "escape")
        (roots["snapshot"] / name / "f").write_text("x")
        private_dirs.remove_child(fd, name)
    finally:
        os.close(fd)
    assert (victim / "keep.txt").read_text() == "keep"
    assert os.listdir(roots["snapshot"]) == []


def test_stale_recovery_removes_only_abandoned_children(roots):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    parent = roots["snapshot"]
    stale = [f".building-{dead.pid}-{'a' * 16}", f"ready-{dead.pid}-{'b' * 16}", f"cache-{dead.pid}-{'c' * 16}"]
    owned = f"ready-{os.getpid()}-{'d' * 16}"
    for name in [*stale, owned]:
        (parent / name / "model").mkdir(parents=True)
        (parent / name / "model" / "w").write_text("x")
        os.chmod(parent / name / "model", 0o500)
    (parent / "unrelated").mkdir()
    report = private_dirs.recover_stale(parent)
    assert sorted(report.removed) == sorted(stale)
    assert report.kept_owned == [owned]
    assert sorted(os.listdir(parent)) == sorted([owned, "unrelated"])


# ------------------------------------------------------------ read limiter


@pytest.mark.parametrize("bad", [0, 16385, True, 2.5])
def test_read_limiter_range(bad):
    with pytest.raises(ValueError, match="1..=16384"):
        ReadLimiter(bad)


def test_read_limiter_earns_no_burst_credit_while_idle():
    limiter = ReadLimiter(4)  # 4 MiB/s
    time.sleep(0.3)  # idle: must not allow the next 1 MiB to go through at once
    start = time.monotonic()
    limiter.consume(1 << 20)
    limiter.consume(1 << 20)
    assert time.monotonic() - start >= 0.45  # 2 MiB at 4 MiB/s = 0.5 s, whatever happened before


def test_read_small_file_refuses_fifos_and_oversize(tmp_path):
    from kiln.system.provenance_io import read_small_file

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ProvenanceError, match="not a regular file"):
        read_small_file(tmp_path / "fifo", 10, None, "input")  # refused at once, never blocks
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(ProvenanceError, match="larger than 10"):
        read_small_file(tmp_path / "big", 10, None, "input")
    limiter = ReadLimiter(None)
    assert read_small_file(tmp_path / "big", 11, limiter, "input") == b"x" * 11 and limiter.total == 11


def test_link_or_special_file_under_adapter_root_refused(tiny_model, tmp_path):
    adapter = build_tiny_adapter(tmp_path / "adapter")
    (adapter / "sub").mkdir()
    os.symlink("/etc/hostname", adapter / "sub" / "l")
    with pytest.raises(SnapshotError, match="symbolic link"):
        snapshot.inventory({"model": tiny_model, "adapter": adapter})
    os.unlink(adapter / "sub" / "l")
    os.mkfifo(adapter / "sub" / "p")
    with pytest.raises(SnapshotError, match="special file"):
        snapshot.inventory({"model": tiny_model, "adapter": adapter})


def test_failed_final_verification_removes_ready_child(tiny_model, roots, monkeypatch):
    def broken(snap, limiter):
        assert os.path.isdir(snap.path) and snap.name.startswith("ready-")
        raise SnapshotError("injected")

    monkeypatch.setattr(snapshot, "verify", broken)
    with pytest.raises(SnapshotError, match="injected"):
        _stage({"model": tiny_model}, roots["snapshot"])
    assert os.listdir(roots["snapshot"]) == []


def test_private_parent_foreign_owner_refused_without_root(tmp_path, monkeypatch):
    p = private_dir(tmp_path / "parent")
    me = os.geteuid()
    monkeypatch.setattr(private_dirs.os, "geteuid", lambda: me + 4242)  # the directory now looks foreign
    with pytest.raises(private_dirs.PrivateDirError, match=f"owned by uid {me}, not the launcher uid {me + 4242}"):
        private_dirs.open_private_parent(p, create=False)
