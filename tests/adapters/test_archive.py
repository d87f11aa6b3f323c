"""Adapter tar.gz safety: every hostile member kind is refused before anything unsafe is written."""

from __future__ import annotations

import gzip
import io
import tarfile
import time
from pathlib import Path

import pytest

from kiln.adapters.archive import MAX_MEMBER_NAME_BYTES, MAX_META_HEADER_BYTES, max_weights_bytes, pack, unpack
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
    assert unpack(tmp / "a.tar.gz", dest) == ["adapter_config.json", "adapter_model.safetensors"]
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
    assert unpack(arc, dest) == ["adapter_config.json", "adapter_model.safetensors"]


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
        ([_special("d", tarfile.DIRTYPE) for _ in range(17)], "more than 16 members"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "too-deep", "symlink", "hardlink", "chardev", "blockdev", "fifo",
         "two-folders", "mixed-levels", "unexpected", "duplicate", "missing", "too-many"],
)
def test_hostile_members_are_refused(members, message, dirs):
    tmp, dest, scratch = dirs
    arc = _tar_gz(tmp / "bad.tar.gz", members)
    with pytest.raises(UnsafeArchive, match=message):
        unpack(arc, dest)
    assert not (tmp / "adapter_config.json").exists() and not Path("/etc/adapter_config.json").exists()
    assert list(scratch.iterdir()) == []


def test_oversize_members_are_refused_before_extraction(dirs):
    tmp, dest, scratch = dirs
    arc = _tar_gz(tmp / "big.tar.gz", [_file("adapter_config.json", CFG), _file("adapter_model.safetensors", b"\0" * 5000)])
    with pytest.raises(AdapterTooLarge):
        unpack(arc, dest, max_bytes=4096)
    assert not (dest / "adapter_model.safetensors").exists()


def test_zero_stream_stops_at_the_end_marker(dirs):
    """64 MiB of zeros is an empty tar: parsing stops at the first zero block, nothing more is inflated."""
    tmp, dest, _scratch = dirs
    bomb = tmp / "bomb.tar.gz"
    with gzip.open(bomb, "wb") as gz:
        for _ in range(64):
            gz.write(b"\0" * (1 << 20))
    started = time.monotonic()
    with pytest.raises(UnsafeArchive, match="lacks"):
        unpack(bomb, dest)
    assert time.monotonic() - started < 1.0


def test_huge_pax_header_is_refused_before_it_is_read(dirs):
    tmp, dest, _scratch = dirs
    info = tarfile.TarInfo("adapter_config.json")
    info.pax_headers = {"comment": "x" * (MAX_META_HEADER_BYTES + 10)}
    arc = _tar_gz(tmp / "pax.tar.gz", [(info, CFG), _file("adapter_model.safetensors")], fmt=tarfile.PAX_FORMAT)
    with pytest.raises(UnsafeArchive, match="metadata header"):
        unpack(arc, dest)


# ---- hostile archives built by hand: the parser that counts is the parser that extracts ----------------------

def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def _pax(records: dict[str, str]) -> bytes:
    body = b""
    for key, value in records.items():
        rest = f" {key}={value}\n".encode()
        n = len(rest) + 1
        while len(str(n)) + len(rest) != n:
            n = len(str(n)) + len(rest)
        body += str(n).encode() + rest
    return _header("././@PaxHeader", len(body), tarfile.XHDTYPE) + _pad(body)


def _gz(path: Path, raw: bytes) -> Path:
    path.write_bytes(gzip.compress(raw + b"\0" * 1024, compresslevel=1))
    return path


def test_pax_size_override_cannot_hide_members(dirs):
    """A pax size of 0 over a ustar size spanning 100,000 headers: those headers are members, and capped."""
    tmp, dest, _scratch = dirs
    hidden = _header("d", 0, tarfile.DIRTYPE) * 100_000
    raw = _pax({"size": "0"}) + _header("d", len(hidden), tarfile.DIRTYPE) + hidden
    arc = _gz(tmp / "hide.tar.gz", raw)
    started = time.monotonic()
    with pytest.raises(UnsafeArchive, match="more than 16 members"):
        unpack(arc, dest)
    assert time.monotonic() - started < 1.0
    assert list(dest.iterdir()) == []


def test_pax_size_is_the_size_that_is_extracted(dirs):
    tmp, dest, _scratch = dirs
    raw = (_pax({"size": str(len(CFG))}) + _header("adapter_config.json", 0) + _pad(CFG)
           + _header("adapter_model.safetensors", len(WEIGHTS)) + _pad(WEIGHTS))
    assert unpack(_gz(tmp / "ok.tar.gz", raw), dest) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (dest / "adapter_config.json").read_bytes() == CFG


@pytest.mark.parametrize("size", [MAX_META_HEADER_BYTES + 1, 64 << 20])
def test_long_pax_name_is_refused_from_its_declared_size(dirs, size):
    """A 64 MiB pax path is refused from its header alone: not read into memory, not echoed."""
    tmp, dest, _scratch = dirs
    raw = _header("././@PaxHeader", size, tarfile.XHDTYPE) + b"a" * min(size, 1 << 20)
    with pytest.raises(UnsafeArchive, match="metadata header") as err:
        unpack(_gz(tmp / "long.tar.gz", raw), dest)
    assert len(str(err.value)) < 200


@pytest.mark.parametrize("kind", ["pax", "gnu"])
def test_long_member_names_are_capped_and_truncated_in_messages(dirs, kind):
    tmp, dest, _scratch = dirs
    name = "n" * 4000
    if kind == "pax":
        raw = _pax({"path": name}) + _header("x", 0)
    else:
        data = name.encode() + b"\0"
        raw = _header("././@LongLink", len(data), tarfile.GNUTYPE_LONGNAME) + _pad(data) + _header("x", 0)
    with pytest.raises(UnsafeArchive, match=f"exceeds {MAX_MEMBER_NAME_BYTES}") as err:
        unpack(_gz(tmp / "n.tar.gz", raw), dest)
    assert len(str(err.value)) < 300


def test_ignored_members_are_never_written_and_are_capped(dirs):
    """A README.md declaring 1 GiB is refused from its header (nothing inflated); a small one is skipped."""
    tmp, dest, _scratch = dirs
    raw = _header("README.md", 1 << 30) + b"\0" * (1 << 20)
    started = time.monotonic()
    with pytest.raises(AdapterTooLarge, match="README.md"):
        unpack(_gz(tmp / "amp.tar.gz", raw), dest)
    assert time.monotonic() - started < 1.0
    assert list(dest.iterdir()) == []
    readme = b"# card\n" * 1000
    raw = (_header("README.md", len(readme)) + _pad(readme) + _header("adapter_config.json", len(CFG)) + _pad(CFG)
           + _header("adapter_model.safetensors", len(WEIGHTS)) + _pad(WEIGHTS))
    assert unpack(_gz(tmp / "card.tar.gz", raw), dest) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_weights_cap_comes_from_the_base_model(dirs, base_info):
    from kiln.adapters.manifest import MAX_LORA_RANK
    from kiln.adapters.validate import base_weight_shapes

    shapes = base_weight_shapes(base_info.path)
    cap = max_weights_bytes(shapes)
    lora_bytes = sum(MAX_LORA_RANK * (s[0] + s[1]) * 8 for k, s in shapes.items() if len(s) == 2)
    assert lora_bytes < cap < lora_bytes + (1 << 20)
    tmp, dest, _scratch = dirs
    arc = _tar_gz(tmp / "big.tar.gz", [_file("adapter_config.json", CFG), _file("adapter_model.safetensors", b"\0" * 5000)])
    with pytest.raises(AdapterTooLarge, match="adapter_model.safetensors"):
        unpack(arc, dest, max_weights=4096)


@pytest.mark.parametrize("payload", [b"not gzip at all", gzip.compress(b"not a tar" * 100, mtime=0)],
                         ids=["not-gzip", "gzip-not-tar"])
def test_garbage_is_refused(payload, dirs):
    tmp, dest, scratch = dirs
    (tmp / "g.tar.gz").write_bytes(payload)
    with pytest.raises(UnsafeArchive):
        unpack(tmp / "g.tar.gz", dest)
