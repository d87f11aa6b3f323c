"""Issue item 3 (document): every status a route returns is in /openapi.json, with the error envelope."""

from __future__ import annotations

import pytest

from kiln.serving.openapi import ROUTE_DOCS


@pytest.fixture(scope="module")
def doc(checker):
    return checker.doc


def test_no_422_anywhere(doc):
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
    assert "HTTPValidationError" not in doc["components"]["schemas"]


@pytest.mark.parametrize(("method", "path"), sorted(ROUTE_DOCS))
def test_route_statuses_documented(doc, method, path):
    spec = ROUTE_DOCS[(method, path)]
    responses = doc["paths"][path][method]["responses"]
    expected = {spec.status, *spec.errors, 403} | ({401} if path != "/health" else set())
    if method in ("post", "delete"):
        expected |= {408, 413, 415}
    assert expected <= {int(s) for s in responses}, sorted(responses)
    for status, response in responses.items():
        if int(status) >= 400:
            assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}


def test_error_envelope_schema(doc):
    body = doc["components"]["schemas"]["ErrorBody"]
    assert set(body["required"]) == {"message", "type", "param", "code", "hint"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streaming_routes_document_sse(doc, path):
    ok = doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    event = ok["text/event-stream"]["x-kiln-event-schema"]["$ref"].rsplit("/", 1)[1]
    assert event in doc["components"]["schemas"]


def test_upload_documents_its_archive_body(doc):
    body = doc["paths"]["/v1/adapters/{name}/upload"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/gzip", "application/octet-stream"}
