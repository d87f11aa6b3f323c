"""Hardening round 3, item 8: strict request types, documented statuses, truthful ``Allow``.

Every response goes through the ``client`` fixture, which fails on any status or body that
``/openapi.json`` does not document.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("value", ["5", 5.0, True])
def test_integer_fields_are_strict(client, secure_server, value):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = client.post(path, json={"model": secure_server.model_id, "max_tokens": value, **body})
        assert r.status_code == 400, (path, value, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and err["param"] == "max_tokens"
    ok = client.post("/v1/completions", json={"model": secure_server.model_id, "prompt": "hi", "max_tokens": 2,
                                              "temperature": 1})  # an integer is a valid number
    assert ok.status_code == 200, ok.text


def test_unknown_eval_suite_is_a_documented_404(client):
    r = client.post("/v1/evals/runs", json={"suite": "no-such-suite"})
    assert r.status_code == 404 and r.json()["error"]["code"] in ("not_found", "suite_not_found"), r.text


def test_405_allow_names_every_method_of_the_path(client):
    r = client.request("OPTIONS", "/v1/adapters/merge")
    assert r.status_code == 405
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"POST", "GET", "DELETE"}, r.headers["allow"]
    r = client.put("/v1/models")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
