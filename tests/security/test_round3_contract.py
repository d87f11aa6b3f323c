"""Hardening round 3, item 8: strict request types, documented statuses, truthful ``Allow``.

Every response goes through the ``client`` fixture, which fails on any status or body that
``/openapi.json`` does not document.
"""

from __future__ import annotations

import pytest


# 5.0 was refused here too until issue 45 item 10: JSON Schema calls it an integer, so the server now takes it
# as 5 (tests/security/test_wire_rules.py::test_a_whole_float_is_an_integer_as_json_schema_says)
@pytest.mark.parametrize("value", ["5", 5.5, True])
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


def test_allow_leaves_out_routes_whose_parameter_cannot_be_the_segment(client):
    """Issue 45 item 8: ``compare`` can never be a judgment ID (``jdg-`` + 16 hex), so the ``{judgment_id}`` route
    does not serve ``/v1/judgments/compare`` and its GET is not in that path's ``Allow``. A segment that is a
    valid value keeps the parameterized route's methods (``merge`` is a valid adapter name, above)."""
    r = client.request("OPTIONS", "/v1/judgments/compare")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers.get("allow")
    r = client.request("OPTIONS", "/v1/judgments/jdg-0123456789abcdef")
    assert r.status_code == 405 and r.headers["allow"] == "GET", r.headers.get("allow")


def test_path_parameters_publish_the_pattern_the_route_accepts(secure_server):
    """Issue 45 item 10: the OpenAPI document states each ID or name path parameter's real pattern and length."""
    import re

    import httpx

    doc = httpx.get(f"{secure_server.base_url}/openapi.json", timeout=30).json()
    params = {(path, p["name"]): p["schema"] for path, ops in doc["paths"].items() for op in ops.values()
              if isinstance(op, dict) for p in op.get("parameters", []) if p["in"] == "path"}
    name = params[("/v1/adapters/{name}", "name")]
    assert name["maxLength"] == 64 and re.fullmatch(name["pattern"], "my-adapter.v2")
    assert not re.fullmatch(name["pattern"], "é") and not re.fullmatch(name["pattern"], "-x")
    assert re.fullmatch(params[("/v1/judgments/{judgment_id}", "judgment_id")]["pattern"], "jdg-0123456789abcdef")
    free = {key for key, schema in params.items() if "pattern" not in schema}  # file names: checked by the route
    assert free == {("/v1/openenv/runs/{run_id}/artifacts/{name}", "name")}, free
