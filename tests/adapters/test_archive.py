"""Adapter tar.gz safety: every hostile member kind is refused before anything unsafe is written."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from kiln.adapters.archive import MAX_META_HEADER_BYTES, pack, unpack
from kiln.adapters.errors import AdapterTooLarge, UnsafeArchive

CFG = b'{"peft_type": "LORA"}'
WEIGHTS = b"\x00" * 100


def _tar_gz(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], fmt=tarfile.USTAR_FORMAT) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    path.write_bytes(gzip.compress(buf.getvalue()))
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def _good() -> list:
    return [_file("adapter_config.json", CFG), _file("adapter_model.safetensors", WEIGHTS)]


@pytest.fixture
def dirs(tmp_path: Path):
    dest, scratch = tmp_path / "dest", tmp_path / "scratch"
    dest.mkdir()
    scratch.mkdir()
    return tmp_path, dest, scratch


def test_roundtrip_with_pack_is_reproducible(dirs):
    tmp, dest, scratch = dirs
    src = tmp / "src"
    src.mkdir()
    (src / "adapter_config.json").write_bytes(CFG)
    (src / "adapter_model.safetensors").write_bytes(WEIGHTS)
    (src / "kiln-manifest.json").write_bytes(b"{}")
    pack(src, tmp / "a.tar.gz", folder="demo")
    pack(src, tmp / "b.tar.gz", folder="demo")
    assert (tmp / "a.tar.gz").read_bytes() == (tmp / "b.tar.gz").read_bytes()
    with tarfile.open(tmp / "a.tar.gz") as tar:
        assert tar.getnames() == ["demo/adapter_config.json", "demo/adapter_model.safetensors", "demo/kiln-manifest.json"]
    assert unpack(tmp / "a.tar.gz", dest, scratch=scratch) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (dest / "adapter_config.json").read_bytes() == CFG
    assert (dest / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert list(scratch.iterdir()) == []


def test_flat_archive_with_dot_folder_is_accepted(dirs):
    tmp, dest, scratch = dirs
    dot = tarfile.TarInfo(".")
    dot.type = tarfile.DIRTYPE
    arc = _tar_gz(tmp / "a.tar.gz", [(dot, None), _file("./adapter_config.json", CFG),
                                     _file("./adapter_model.safetensors", WEIGHTS)], fmt=tarfile.PAX_FORMAT)
    assert unpack(arc, dest, scratch=scratch) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([_file("../adapter_config.json", CFG), _file("adapter_model.safetensors")], "unsafe member path"),
        ([_file("a/../../adapter_config.json", CFG), _file("adapter_model.safetensors")], "unsafe member path"),
        ([_file("/etc/adapter_config.json", CFG), _file("adapter_model.safetensors")], "unsafe member path"),
        ([_file("a/b/adapter_config.json", CFG)], "unsafe member path"),
        ([_special("adapter_config.json", tarfile.SYMTYPE, "/etc/passwd")], "link"),
        ([_file("adapter_model.safetensors"), _special("adapter_config.json", tarfile.LNKTYPE, "adapter_model.safetensors")], "link"),
        ([_special("adapter_config.json", tarfile.CHRTYPE)], "special member"),
        ([_special("adapter_config.json", tarfile.BLKTYPE)], "special member"),
        ([_special("adapter_config.json", tarfile.FIFOTYPE)], "special member"),
        ([_file("a/adapter_config.json", CFG), _file("b/adapter_model.safetensors")], "one folder"),
        ([_file("adapter_config.json", CFG), _file("a/adapter_model.safetensors")], "one folder"),
        ([*_good(), _file("evil.py", b"import os")], "unexpected file"),
        ([*_good(), _file("adapter_config.json", CFG)], "appears twice"),
        ([_file("adapter_config.json", CFG)], "lacks adapter_model.safetensors"),
        ([_file(f"f{i}") for i in range(17)], "more than 16 members"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "too-deep", "symlink", "hardlink", "chardev", "blockdev", "fifo",
         "two-folders", "mixed-levels", "unexpected", "duplicate", "missing", "too-many"],
)
def test_hostile_members_are_refused(members, message, dirs):
    tmp, dest, scratch = dirs
    arc = _tar_gz(tmp / "bad.tar.gz", members)
    with pytest.raises(UnsafeArchive, match=message):
        unpack(arc, dest, scratch=scratch)
    assert not (tmp / "adapter_config.json").exists() and not Path("/etc/adapter_config.json").exists()
    assert list(scratch.iterdir()) == []


def test_oversize_members_are_refused_before_extraction(dirs):
    tmp, dest, scratch = dirs
    arc = _tar_gz(tmp / "big.tar.gz", [_file("adapter_config.json", CFG), _file("adapter_model.safetensors", b"\0" * 5000)])
    with pytest.raises(AdapterTooLarge):
        unpack(arc, dest, scratch=scratch, max_bytes=4096)
    assert not (dest / "adapter_model.safetensors").exists()


def test_decompression_bomb_is_cut_off_at_the_cap(dirs):
    tmp, dest, scratch = dirs
    bomb = tmp / "bomb.tar.gz"
    with gzip.open(bomb, "wb") as gz:
        for _ in range(64):
            gz.write(b"\0" * (1 << 20))  # 64 MiB of zeros, about 64 KiB compressed
    assert bomb.stat().st_size < 200_000
    with pytest.raises(AdapterTooLarge, match="unpacks to more than"):
        unpack(bomb, dest, scratch=scratch, max_bytes=1 << 20)
    assert list(scratch.iterdir()) == []


def test_huge_pax_header_is_refused_before_tarfile_reads_it(dirs):
    tmp, dest, scratch = dirs
    info = tarfile.TarInfo("adapter_config.json")
    info.pax_headers = {"comment": "x" * (MAX_META_HEADER_BYTES + 10)}
    arc = _tar_gz(tmp / "pax.tar.gz", [(info, CFG), _file("adapter_model.safetensors")], fmt=tarfile.PAX_FORMAT)
    with pytest.raises(UnsafeArchive, match="metadata header"):
        unpack(arc, dest, scratch=scratch)


@pytest.mark.parametrize("payload", [b"not gzip at all", gzip.compress(b"not a tar" * 100)])
def test_garbage_is_refused(payload, dirs):
    tmp, dest, scratch = dirs
    (tmp / "g.tar.gz").write_bytes(payload)
    with pytest.raises(UnsafeArchive):
        unpack(tmp / "g.tar.gz", dest, scratch=scratch)
