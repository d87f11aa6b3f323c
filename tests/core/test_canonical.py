from __future__ import annotations

import hashlib
import math
import os
import struct

import pytest

from kiln import canonical as c


def test_canonical_json_sorts_keys_and_drops_whitespace() -> None:
    assert c.canonical_json({"b": 1, "a": [1, {"d": 2, "c": "é"}]}) == '{"a":[1,{"c":"é","d":2}],"b":1}'
    assert c.canonical_json_bytes({"k": "é"}) == '{"k":"é"}'.encode("utf-8")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_canonical_json_rejects_non_finite(bad: float) -> None:
    with pytest.raises(c.CanonicalJSONError):
        c.canonical_json({"x": bad})


def test_ordered_json_keeps_caller_order() -> None:
    assert c.ordered_json_bytes({"z": 1, "a": 2}) == b'{"z":1,"a":2}'


def test_domain_digest_is_sha256_of_domain_nul_payload() -> None:
    assert c.domain_digest("kiln.x.v1", b"ab", b"c") == hashlib.sha256(b"kiln.x.v1\x00abc").hexdigest()
    with pytest.raises(ValueError):
        c.domain_digest("bad\x00domain")


def test_base64url_nopad() -> None:
    assert c.base64url_nopad(b"\xff\xfe") == "__4"


def test_strict_json_rejects_duplicates_and_nan() -> None:
    with pytest.raises(c.CanonicalJSONError):
        c.strict_json_loads('{"a":1,"a":2}')
    with pytest.raises(c.CanonicalJSONError):
        c.strict_json_loads('{"a":NaN}')
    with pytest.raises(c.CanonicalJSONError):
        c.strict_json_loads("{")


def test_jsonl_c14n_newline_forms_share_normalized_hash() -> None:
    lf = c.jsonl_c14n(b'{"b":1,"a":2}\n{"x":"\xc3\xa9"}\n')
    crlf = c.jsonl_c14n(b'\xef\xbb\xbf{ "a": 2, "b": 1 }\r\n{"x":"\xc3\xa9"}')
    cr = c.jsonl_c14n(b'{"a":2,"b":1}\r{"x":"\\u00e9"}\r')
    assert lf.normalized == b'{"a":2,"b":1}\n{"x":"\xc3\xa9"}\n'
    assert lf.normalized_sha256 == crlf.normalized_sha256 == cr.normalized_sha256
    assert len({lf.source_sha256, crlf.source_sha256, cr.source_sha256}) == 3
    assert lf.rows == crlf.rows == 2


@pytest.mark.parametrize(
    "src, what",
    [
        (b'{"a":1}\n\n{"b":2}\n', "blank"),
        (b'{"a":1,"a":2}\n', "duplicate"),
        (b"[1,2]\n", "not a JSON object"),
        (b'{"a":\n', "malformed"),
        (b'\xff\n', "UTF-8"),
    ],
)
def test_jsonl_c14n_rejections(src: bytes, what: str) -> None:
    with pytest.raises(c.JSONLNormalizationError, match=what):
        c.jsonl_c14n(src)


def test_jsonl_c14n_keeps_line_separator_inside_strings() -> None:
    d = c.jsonl_c14n('{"a":"x\u2028y"}\n'.encode("utf-8"))
    assert d.rows == 1 and d.objects() == [{"a": "x\u2028y"}]


def test_base_model_digest_layout() -> None:
    d1, d2 = "11" * 32, "00" * 32
    expected = hashlib.sha256(
        b"kiln.base-model-content.v1\x00"
        + struct.pack("<Q", 2)
        + struct.pack("<Q", 7) + bytes.fromhex(d2)
        + struct.pack("<Q", 5) + bytes.fromhex(d1)
    ).hexdigest()
    assert c.base_model_digest([(d1, 5), (d2, 7)]) == expected
    assert c.base_model_digest([(d2, 7), (d1, 5)]) == expected


def test_atomic_write_replaces_whole_file(tmp_path) -> None:
    p = tmp_path / "sub" / "state.json"
    c.atomic_write_json(p, {"v": 1})
    c.atomic_write_json(p, {"v": 2})
    assert p.read_bytes() == b'{"v":2}\n'
    assert [x.name for x in p.parent.iterdir()] == ["state.json"]


def test_atomic_publish_dir_never_overwrites(tmp_path) -> None:
    staging = tmp_path / ".staging"
    staging.mkdir()
    (staging / "f").write_bytes(b"x")
    final = tmp_path / "final"
    c.atomic_publish_dir(staging, final)
    assert (final / "f").read_bytes() == b"x" and not staging.exists()
    other = tmp_path / ".staging2"
    other.mkdir()
    with pytest.raises(FileExistsError):
        c.atomic_publish_dir(other, final)


def test_sha256_file_refuses_symlink(tmp_path) -> None:
    target = tmp_path / "t"
    target.write_bytes(b"abc")
    assert c.sha256_file(target) == (hashlib.sha256(b"abc").hexdigest(), 3)
    link = tmp_path / "l"
    os.symlink(target, link)
    with pytest.raises(OSError):
        c.sha256_file(link)
