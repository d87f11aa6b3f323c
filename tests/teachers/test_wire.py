"""The compact binary scoring answer: round trip, bounds, and negotiation on a real server."""

from __future__ import annotations

import math

import httpx
import pytest

from kiln.teachers.wire import FINGERPRINT_HEADER, MEDIA_TYPE, WireError, decode, encode
from tests.teachers.test_registry import pair  # noqa: F401  (the two real servers)

ROWS = [[None, {"5": {"logprob": -0.25}, "9": {"logprob": -1.5}}, {"7": {"logprob": -3.0}}]]


def test_round_trip():
    fp, model, rows = decode(encode("kiln-teacher-v1.x.y", "m", ROWS), vocab_size=10, top_k=1)
    assert (fp, model) == ("kiln-teacher-v1.x.y", "m")
    assert rows == [[None, {5: -0.25, 9: -1.5}, {7: -3.0}]]


@pytest.mark.parametrize("kw,match", [({"vocab_size": 8}, "vocabulary"), ({"top_k": 0}, "top_k")])
def test_bounds_refused(kw, match):
    with pytest.raises(WireError, match=match):
        decode(encode("f", "m", ROWS), **kw)


def test_truncated_and_trailing_refused():
    data = encode("f", "m", ROWS)
    with pytest.raises(WireError, match="truncated"):
        decode(data[:-3])
    with pytest.raises(WireError, match="trailing"):
        decode(data + b"\0")
    with pytest.raises(WireError, match="magic"):
        decode(b"JSON" + data)


def test_server_answers_binary_when_asked(pair):  # noqa: F811
    teacher, _, _ = pair
    body = {"model": teacher.model_id, "prompt": [[5, 6, 7, 8], [9, 10, 11]], "max_tokens": 1,
            "prompt_logprobs": 3}
    js = httpx.post(f"{teacher.base_url}/v1/completions", json=body, timeout=60)
    bi = httpx.post(f"{teacher.base_url}/v1/completions", json=body, timeout=60,
                    headers={"Accept": f"{MEDIA_TYPE}, application/json;q=0.5"})
    assert js.headers["content-type"].startswith("application/json")
    assert bi.status_code == 200 and bi.headers["content-type"] == MEDIA_TYPE
    fp, model, rows = decode(bi.content, vocab_size=None, top_k=3)
    assert fp == bi.headers[FINGERPRINT_HEADER] == js.json()["system_fingerprint"]
    assert model == teacher.model_id
    want = [c["prompt_logprobs"] for c in js.json()["choices"]]
    for got_p, want_p in zip(rows, want):
        assert got_p[0] is None and want_p[0] is None
        for g, w in zip(got_p[1:], want_p[1:]):
            assert set(g) == {int(k) for k in w}
            assert all(math.isclose(g[int(k)], v["logprob"], rel_tol=1e-6, abs_tol=1e-6) for k, v in w.items())
    assert len(bi.content) < len(js.content) / 2
    # Errors and non-scoring answers stay JSON.
    r = httpx.post(f"{teacher.base_url}/v1/completions", json={**body, "model": "nope"}, timeout=60,
                   headers={"Accept": MEDIA_TYPE})
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
