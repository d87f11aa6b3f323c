"""ASGI middleware that bounds request bodies before anything parses them.

A declared ``Content-Length`` over the limit is refused at once; a body sent
without one (chunked) is counted as it streams and refused as soon as it passes
the limit. Either way the client gets a 413 in Kiln's error envelope.
"""

from __future__ import annotations

import re

from starlette.exceptions import HTTPException

from kiln.serving.errors import TrackingSend, send_error

HINT = "send a smaller body (server.max_body_bytes bounds it)"


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` mid-stream; the app's HTTP error handler turns it into a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the {limit}-byte limit (server.max_body_bytes)")


class BodyLimitMiddleware:
    """``max_body_bytes`` for every route, except paths matching an override pattern.

    ``overrides`` maps a full-match regular expression over the request path to its
    own limit, or to ``None`` for a route that bounds its body itself while streaming
    it (adapter uploads, capped by ``adapters.max_upload_bytes`` in the route).
    """

    def __init__(self, app, max_body_bytes: int, overrides: dict[str, int | None] | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.overrides = [(re.compile(pattern), limit) for pattern, limit in (overrides or {}).items()]

    def limit_for(self, path: str) -> int | None:
        for pattern, limit in self.overrides:
            if pattern.fullmatch(path):
                return limit
        return self.max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope.get("path", ""))
        if limit is None:
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await send_error(send, 400, "bad_request", "Content-Length is not an integer",
                                            "send a decimal Content-Length")
                if declared > limit:
                    return await send_error(send, 413, "payload_too_large",
                                            f"request body of {declared} bytes exceeds the {limit}-byte limit", HINT)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        tracking_send = TrackingSend(send)
        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not tracking_send.started:
                await send_error(send, 413, "payload_too_large", f"request body exceeds the {limit}-byte limit", HINT)
