"""Dataset canonicalization (soup-jsonl-c14n-v1) and the plan's dataset binding."""

from __future__ import annotations

import json

import pytest

from kiln.canonical import JSONLNormalizationError, jsonl_c14n, sha256_hex
from kiln.distill.dataset import check_dataset, fingerprint_dataset
from kiln.distill.errors import ContractError, PathSafetyError

from tests.distill.conftest import FIXTURES

CANON = b'{"a":1,"b":"x"}\n{"a":2}\n'


@pytest.mark.parametrize(
    "variant",
    [
        CANON,
        b'{"b": "x", "a": 1}\r\n{ "a" : 2 }\r\n',
        b'{"b":"x","a":1}\r{"a":2}',
        b"\xef\xbb\xbf" + b'{"a":1,"b":"x"}\n{"a":2}',
        b'{"a":1,"b":"\\u0078"}\n{"a":2}\n',
    ],
)
def test_formatting_variants_share_the_normalized_hash(variant: bytes) -> None:
    d = jsonl_c14n(variant)
    assert d.rows == 2
    assert d.normalized == CANON and d.normalized_sha256 == sha256_hex(CANON)
    assert d.source_sha256 == sha256_hex(variant) and d.source_bytes == len(variant)


def test_unicode_is_kept_and_line_separators_do_not_split_rows() -> None:
    src = '{"s":"caf\u00e9 \u2028 \u2029 \U0001f600"}\n'.encode()
    d = jsonl_c14n(src)
    assert d.rows == 1 and d.normalized == src
    assert d.objects() == [{"s": "caf\u00e9 \u2028 \u2029 \U0001f600"}]


def test_row_order_is_preserved() -> None:
    assert jsonl_c14n(b'{"a":2}\n{"a":1}\n').normalized_sha256 != jsonl_c14n(CANON).normalized_sha256


@pytest.mark.parametrize(
    "bad,match",
    [
        (b'{"a":1}\n\n{"a":2}\n', "blank row"),
        (b'{"a":1}\n   \n', "blank row"),
        (b'{"a":1}\n\n', "blank row"),
        (b'{"a":1,"a":2}\n', "duplicate"),
        (b'{"a":\n', "malformed"),
        (b"[1,2]\n", "not a JSON object"),
        (b'{"a":NaN}\n', "non-finite"),
        (b'{"a":1e400}\n', "non-finite"),
        (b'{"a":"\\ud800"}\n', "UTF-8"),
        (b'{"a":"\xff"}\n', "UTF-8"),
        (b"\xef\xbb\xbf\xef\xbb\xbf{}\n", "malformed"),
    ],
)
def test_invalid_sources_are_rejected(bad: bytes, match: str) -> None:
    with pytest.raises(JSONLNormalizationError, match=match):
        jsonl_c14n(bad)


def test_dataset_fixture_matches_the_plan(expert_plan) -> None:
    summary = check_dataset(FIXTURES, expert_plan)
    assert summary.target_tokens == expert_plan.capture.planned_tokens == 2
    assert summary.fingerprint == expert_plan.dataset


def test_crlf_dataset_keeps_normalized_hash_but_is_a_different_source(tmp_path, expert_plan) -> None:
    raw = (FIXTURES / "dataset.jsonl").read_bytes()
    (tmp_path / "dataset.jsonl").write_bytes(raw.replace(b"\n", b"\r\n"))
    fp = fingerprint_dataset(tmp_path, ["dataset.jsonl"]).fingerprint
    assert fp.normalized_sha256 == expert_plan.dataset.normalized_sha256
    assert fp.files[0].sha256 != expert_plan.dataset.files[0].sha256
    with pytest.raises(ContractError, match="different run"):
        check_dataset(tmp_path, expert_plan)


def test_dataset_rows_must_be_tokenized_examples(tmp_path) -> None:
    row = json.loads((FIXTURES / "dataset.jsonl").read_bytes())
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ContractError, match="appears twice"):
        fingerprint_dataset(tmp_path, ["d.jsonl"])
    (tmp_path / "e.jsonl").write_text(json.dumps(dict(row, prompt_token_ids=[])) + "\n")
    with pytest.raises(ContractError, match="prompt_token_ids"):
        fingerprint_dataset(tmp_path, ["e.jsonl"])


def test_dataset_paths_cannot_escape_or_follow_links(tmp_path) -> None:
    (tmp_path / "real.jsonl").write_bytes((FIXTURES / "dataset.jsonl").read_bytes())
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    for rel in ("../real.jsonl", "/etc/passwd", "link.jsonl"):
        with pytest.raises(PathSafetyError):
            fingerprint_dataset(tmp_path / "root", [rel])
