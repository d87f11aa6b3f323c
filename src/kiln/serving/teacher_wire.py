"""``Accept: application/x-kiln-prompt-logprobs`` on ``POST /v1/completions``: the scoring answer in the
compact binary layout of :mod:`kiln.teachers.wire` (8 bytes per candidate instead of ~30-60 in JSON).

An ASGI middleware around the generation routes: when the client prefers the
binary type and the answer is a 200 JSON scoring answer (every choice has
``prompt_logprobs``), it is re-encoded; anything else passes through unchanged.
The JSON answer is built first and transcoded here, so the server pays the
JSON cost once; the client saves the bytes and its parse time.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.teachers.wire import FINGERPRINT_HEADER, MEDIA_TYPE, transcode_json

PATH = "/v1/completions"


class TeacherWireMiddleware:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") != PATH or scope.get("method") != "POST" or \
                not any(k == b"accept" and MEDIA_TYPE.encode() in v for k, v in scope.get("headers", ())):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                await _finish(start, b"".join(chunks), send)
                return
            await send(message)

        await self.app(scope, receive, capture)


async def _finish(start: dict[str, Any], body: bytes, send) -> None:
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    ctype = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
    out = None
    if start.get("status") == 200 and ctype.startswith(b"application/json"):
        try:
            out = transcode_json(json.loads(body))
        except (ValueError, TypeError, KeyError):
            out = None
    if out is None:
        await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    fp = json.loads(body).get("system_fingerprint") or ""
    headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    headers += [(b"content-type", MEDIA_TYPE.encode()), (b"content-length", str(len(out)).encode()),
                (FINGERPRINT_HEADER.encode(), str(fp).encode())]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": out})
