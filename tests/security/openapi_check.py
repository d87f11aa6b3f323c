"""Validate real responses against the server's own ``/openapi.json``.

:class:`OpenAPIChecker` finds the operation for a method and a concrete path,
checks that the status is documented, that the media type is one the document
lists, and validates the JSON body (or every SSE event, against the operation's
``x-kiln-event-schema``) with jsonschema, ``$ref`` resolved inside the document.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema


class SchemaMismatch(AssertionError):
    pass


@dataclass
class OpenAPIChecker:
    doc: dict[str, Any]
    seen: list[tuple[str, str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ops = []
        for template, item in self.doc["paths"].items():
            regex = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
            for method, op in item.items():
                self._ops.append((method.upper(), regex, template, op))
        self._components = {"components": self.doc["components"]}

    def operation(self, method: str, path: str) -> tuple[str, dict[str, Any]]:
        for m, regex, template, op in self._ops:
            if m == method.upper() and regex.match(path):
                return template, op
        raise SchemaMismatch(f"{method} {path} is not in the OpenAPI document")

    def validate(self, instance: Any, schema: dict[str, Any], where: str) -> None:
        try:
            jsonschema.Draft202012Validator({**self._components, **schema}).validate(instance)
        except jsonschema.ValidationError as exc:
            raise SchemaMismatch(f"{where}: {exc.message} at {list(exc.absolute_path)}") from None

    def check(self, method: str, path: str, status: int, content_type: str | None, body: bytes) -> None:
        where = f"{method} {path} -> {status}"
        try:
            template, op = self.operation(method, path)
        except SchemaMismatch:  # no such route (404) or method (405): still the error envelope
            assert status in (404, 405), f"{where}: not in the OpenAPI document"
            self.validate(json.loads(body), {"$ref": "#/components/schemas/ErrorResponse"}, where)
            return
        self.seen.append((method.upper(), template, status))
        response = op["responses"].get(str(status))
        if response is None:
            raise SchemaMismatch(f"{where}: status not documented (documented: {sorted(op['responses'])})")
        media = (content_type or "").split(";")[0].strip().lower()
        content = response.get("content", {})
        if media not in content:
            raise SchemaMismatch(f"{where}: media type {media!r} not documented ({sorted(content)})")
        entry = content[media]
        if media == "application/json":
            self.validate(json.loads(body), entry["schema"], where)
        elif media == "text/event-stream":
            events = sse_events(body)
            assert events and events[-1] == "[DONE]", f"{where}: stream does not end with [DONE]"
            for event in events[:-1]:
                self.validate(json.loads(event), entry["x-kiln-event-schema"], where + " (event)")

    def check_httpx(self, response) -> None:
        request = response.request
        self.check(request.method, request.url.path, response.status_code,
                   response.headers.get("content-type"), response.read())


def checked_client(base_url: str, checker: OpenAPIChecker, **kw: Any):
    """An ``httpx.Client`` whose every response is checked with ``checker`` (use it as a context manager)."""
    import httpx

    return httpx.Client(base_url=base_url, timeout=60, event_hooks={"response": [checker.check_httpx]}, **kw)


def fetch_checker(base_url: str) -> OpenAPIChecker:
    import httpx

    return OpenAPIChecker(httpx.get(f"{base_url}/openapi.json", timeout=30).json())


def sse_events(body: bytes) -> list[str]:
    return [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]
