"""Kill publication (and deletion) for real at every named step, then check the store.

Each case runs the operation in a fresh Python process with ``KILN_FAULT_POINT``
set, so the process dies with ``os._exit(137)`` exactly there: no finally
blocks, no atexit handlers. Afterwards the store must show the old state or the
complete new adapter, and ``cleanup()`` plus a later publication must recover.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.adapters.errors import AdapterNotFound
from kiln.adapters.store import (
    FAULT_ENV,
    FAULT_EXIT_CODE,
    KEEP_PREVIOUS_REVISIONS,
    PUBLISH_FAULT_POINTS,
    STAGING_DIR,
    TRASH_DIR,
    AdapterStore,
)

CHILD = r"""
import shutil, sys
from pathlib import Path
from kiln.adapters.store import AdapterStore
op, root, name = sys.argv[1:4]
store = AdapterStore(root)
if op == "delete":
    store.delete(name)
else:
    src, base_dir, base_sha = sys.argv[4:7]
    staging = store.new_staging()
    for f in Path(src).iterdir():
        shutil.copy2(f, staging / f.name)
    store.publish(staging, name=name, base_model_sha256=base_sha, kind="sft", config={"lr": 0.001},
                  inputs_sha256=None, parent_revision=None, base_model_dir=base_dir)
print("completed")
"""

# Steps before HEAD moves must leave the old state; after it, the new adapter.
EXPECT_NEW = {"after_validate": False, "after_manifest": False, "after_rename": False, "after_head": True}


def _child(op: str, root: Path, name: str, *args: str, fault: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run(
        [sys.executable, "-c", CHILD, op, str(root), name, *args],
        env=env, capture_output=True, text=True, timeout=120,
    )


def _assert_clean(store: AdapterStore) -> None:
    assert list((store.root / STAGING_DIR).iterdir()) == []
    assert list((store.root / TRASH_DIR).iterdir()) == []
    for name_dir in store.root.iterdir():
        if name_dir.name.startswith("."):
            continue
        head = store.get(name_dir.name)
        kept = {p.name for p in (name_dir / "revisions").iterdir()}
        assert head.revision in kept and len(kept) <= KEEP_PREVIOUS_REVISIONS + 1
        assert not list(name_dir.glob(".HEAD.*"))
        store.verify(name_dir.name)


def test_fault_points_cover_every_publication_step():
    assert set(EXPECT_NEW) == set(PUBLISH_FAULT_POINTS)


@pytest.mark.parametrize("existing", [False, True], ids=["new-name", "existing-name"])
@pytest.mark.parametrize("point", PUBLISH_FAULT_POINTS)
def test_kill_during_publication_leaves_old_or_complete_new(point, existing, make_lora, base_info, tmp_path):
    root = tmp_path / "store"
    store = AdapterStore(root)
    reference = AdapterStore(tmp_path / "reference")
    new_src = make_lora(seed=100)
    args = (str(new_src), str(base_info.path), base_info.base_model_sha256)
    new_rev = reference.publish(
        _stage(reference, new_src), name="x", base_model_sha256=base_info.base_model_sha256, kind="sft",
        config={"lr": 0.001}, base_model_dir=base_info,
    ).revision
    old_rev = None
    if existing:
        old_rev = store.publish(
            _stage(store, make_lora(seed=101)), name="crash", base_model_sha256=base_info.base_model_sha256,
            kind="sft", config={}, base_model_dir=base_info,
        ).revision

    proc = _child("publish", root, "crash", *args, fault=point)
    assert proc.returncode == FAULT_EXIT_CODE, proc.stderr
    assert "completed" not in proc.stdout

    orphan = root / "crash" / "revisions" / new_rev
    assert orphan.is_dir() == (point in ("after_rename", "after_head"))  # the kill landed where named
    after = AdapterStore(root)
    if EXPECT_NEW[point]:
        assert after.get("crash").revision == new_rev
        after.verify("crash")
    elif existing:
        assert after.get("crash").revision == old_rev
        after.verify("crash")
    else:
        with pytest.raises(AdapterNotFound):
            after.get("crash")
        assert [r.name for r in after.list()] == []

    after.cleanup()
    _assert_clean(after)
    assert orphan.is_dir() == EXPECT_NEW[point]  # an unreferenced new revision is reclaimed

    proc = _child("publish", root, "crash", *args, fault=None)
    assert proc.returncode == 0, proc.stderr
    final = AdapterStore(root)
    assert final.get("crash").revision == new_rev
    _assert_clean(final)


def test_kill_during_delete_leaves_nothing_visible(make_lora, base_info, tmp_path):
    root = tmp_path / "store"
    store = AdapterStore(root)
    store.publish(
        _stage(store, make_lora(seed=102)), name="victim", base_model_sha256=base_info.base_model_sha256,
        kind="sft", config={}, base_model_dir=base_info,
    )
    proc = _child("delete", root, "victim", fault="delete_after_trash")
    assert proc.returncode == FAULT_EXIT_CODE, proc.stderr
    after = AdapterStore(root)
    with pytest.raises(AdapterNotFound):
        after.get("victim")
    assert list((root / TRASH_DIR).iterdir())  # the crash really left the files behind
    after.cleanup()
    _assert_clean(after)


def test_a_killed_trainer_staging_is_reclaimed(make_lora, base_info, tmp_path):
    """A process that dies while holding a staging dir (before publish) leaves garbage that cleanup removes."""
    root = tmp_path / "store"
    AdapterStore(root)
    code = (
        "import os, sys\nfrom kiln.adapters.store import AdapterStore\n"
        "s = AdapterStore(sys.argv[1]).new_staging()\n(s / 'adapter_config.json').write_text('{}')\n"
        "os._exit(137)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 137, proc.stderr
    assert len(list((root / STAGING_DIR).iterdir())) == 2  # the dir and its lock file
    report = AdapterStore(root).cleanup()
    assert report.staging_removed == 1
    assert list((root / STAGING_DIR).iterdir()) == []


def _stage(store: AdapterStore, src: Path):
    staging = store.new_staging()
    for f in src.iterdir():
        (staging / f.name).write_bytes(f.read_bytes())
    return staging
