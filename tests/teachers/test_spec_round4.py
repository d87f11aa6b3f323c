"""Spec deviations round 4 (issue 44), teacher side: each test quotes the clause of
shared/spec/teacher-launcher.txt it enforces and was written from those words before the fix."""

from __future__ import annotations

import base64
import hashlib
import struct

import pytest

from kiln.teachers.kiln_identity import identity_from_fingerprint
from kiln.teachers.probe import RemoteTeacher, ScoreResult, TeacherRefused, check_answer


def fingerprint_of(payload: bytes) -> str:
    """``kiln-teacher-v1.<base64url without padding>.<sha256 of JSON>`` over arbitrary payload bytes."""
    b64 = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    return f"kiln-teacher-v1.{b64}.{hashlib.sha256(payload).hexdigest()}"


# ---- item 8 -------------------------------------------------------------------------------
# "fingerprint:    kiln-teacher-v1.<base64url without padding>.<sha256 of JSON>" / "Kiln therefore
#  rejects stock vllm-* fingerprints and accepts only the canonical kiln-teacher-v1 fingerprint".
# Anything else is refused as an invalid fingerprint, whatever its shape.


@pytest.mark.parametrize("depth", [100_000, 1_000])
def test_a_deeply_nested_fingerprint_payload_is_a_typed_refusal(depth):
    fp = fingerprint_of(b"[" * depth + b"]" * depth)
    with pytest.raises(ValueError, match="fingerprint"):
        identity_from_fingerprint(fp)
    with pytest.raises(TeacherRefused) as err:
        check_answer(ScoreResult(fp, "m", [], 0), model_id="m", pinned=None)
    assert err.value.code == "teacher_fingerprint_invalid"


# ---- item 9 -------------------------------------------------------------------------------
# Same clause: a fingerprint is a text token of that form; a binary answer whose fingerprint bytes
# are not UTF-8 carries no canonical fingerprint and is refused as an invalid answer.


def _binary_answer(fingerprint: bytes, model: bytes = b"m") -> bytes:
    from kiln.teachers.wire import MAGIC

    return MAGIC + struct.pack("<I", len(fingerprint)) + fingerprint + struct.pack("<I", len(model)) + model + \
        struct.pack("<I", 0)


@pytest.mark.parametrize("field", ["fingerprint", "model"])
def test_a_binary_answer_with_non_utf8_text_is_a_typed_refusal(field):
    bad = b"\xff\xfe\xfd"
    data = _binary_answer(bad) if field == "fingerprint" else _binary_answer(b"kiln-teacher-v1.x.y", bad)
    with pytest.raises(TeacherRefused, match="UTF-8"):
        RemoteTeacher._binary(data, [], 1, None)
    # a payload (inside a well-formed fingerprint) that is not UTF-8
    with pytest.raises(TeacherRefused) as err:
        check_answer(ScoreResult(fingerprint_of(b'{"a":"\xff"}'), "m", [], 0), model_id="m", pinned=None)
    assert err.value.code == "teacher_fingerprint_invalid" and "UTF-8" in str(err.value)
