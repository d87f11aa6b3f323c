"""The one place where errors become HTTP: the OpenAI error envelope.

Every failure answers ``{"error": {"message", "type", "param", "code", "hint"}}``,
the body the ``openai`` and vLLM clients parse (``hint`` is Kiln's extra: what to
do about it). :func:`kiln_error_response` maps a :class:`kiln.errors.KilnError`;
the handlers installed by :func:`install_error_handlers` rewrite FastAPI's
request validation errors (400, as OpenAI and vLLM answer, with ``param`` naming
the first offending field), unknown routes/methods and unexpected exceptions
(500, logged) into the same envelope.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Callable, Iterable, MutableMapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.errors import KilnError, error_type

log = logging.getLogger("kiln.serving")

MAX_VALIDATION_PROBLEMS = 10
RETRY_STATUSES = (429, 503)
DEFAULT_RETRY_AFTER_S = 1


def error_body(status: int, code: str, message: str, hint: str = "", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code, "hint": hint}}


def error_response(status: int, code: str, message: str, hint: str = "", *, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    if status in RETRY_STATUSES and not (headers and "Retry-After" in headers):
        headers = {**(headers or {}), "Retry-After": str(DEFAULT_RETRY_AFTER_S)}
    return JSONResponse(error_body(status, code, message, hint, param), status_code=status, headers=headers)


async def send_error(send: Callable, status: int, code: str, message: str, hint: str = "",
                     extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send the envelope through raw ASGI ``send`` (for middlewares that answer before the app)."""
    body = json.dumps(error_body(status, code, message, hint)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class TrackingSend:
    """An ASGI ``send`` that remembers whether the response has started (so an error can still be sent)."""

    def __init__(self, send: Callable):
        self._send = send
        self.started = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


def kiln_error_response(exc: KilnError, redact: Callable[[str], str] = str) -> JSONResponse:
    """The envelope for ``exc``; ``redact`` rewrites message and hint (server paths out)."""
    headers = None
    if exc.retry_after is not None:
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    return error_response(exc.status, exc.code, redact(exc.message), redact(exc.hint), param=exc.param,
                          headers=headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "payload_too_large",
               400: "bad_request"}


def http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    hint = "see GET /docs for the available endpoints" if exc.status_code in (404, 405) else ""
    return error_response(exc.status_code, code, str(exc.detail), hint, headers=getattr(exc, "headers", None))


def unexpected_error_response(exc: Exception) -> JSONResponse:
    """A 500 for a bug; logs the traceback (call it inside the ``except`` block)."""
    log.exception("unhandled error")
    return error_response(500, "internal_error", f"internal error: {type(exc).__name__}",
                          "this is a server bug; the server log has the traceback")


def validation_error_response(errors: list[dict[str, Any]]) -> JSONResponse:
    """400 for a body that fails its schema (``param`` = the first offending field)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "invalid_json", "the request body is not valid JSON",
                              "send a JSON object with Content-Type: application/json")
    problems = []
    params = []
    for err in errors[:MAX_VALIDATION_PROBLEMS]:
        loc = field_path(err.get("loc", ()))
        wrong_type = str(err.get("type", "")).endswith(("_type", "_parsing"))
        params.append(((not wrong_type, len(err.get("loc", ()))), loc))
        problems.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (+{len(errors) - MAX_VALIDATION_PROBLEMS} more)" if len(errors) > MAX_VALIDATION_PROBLEMS else ""
    # a value no member of a union accepts fails once per member; the member whose type it has, and then
    # the one it got furthest into, names it
    param = max(params, key=lambda rank_loc: rank_loc[0])[1] if params else None
    return error_response(400, "invalid_request", "; ".join(problems) + more,
                          "fix the listed fields; see GET /docs for the request schema", param=param)


def field_path(loc: Any) -> str:
    """A validation error's location as the caller wrote it: ``prompt[1]``, ``messages[0].content``.
    The body marker and pydantic's union-member tags (``constrained-str``, ``list[int]``) are not fields."""
    path = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and _UNION_TAG.search(part)):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


_UNION_TAG = re.compile(r"[\[\]-]")


def allowed_methods(app: FastAPI, scope: MutableMapping[str, Any]) -> str:
    """Every method some route serves at ``scope``'s path (``/v1/adapters/merge`` is both the merge
    route, POST, and ``/v1/adapters/{name}``, GET and DELETE), for a 405's ``Allow``. A route whose path
    parameter's published pattern (:mod:`kiln.serving.path_params`) rejects the segment does not serve
    the path: ``/v1/judgments/compare`` is POST only, ``compare`` is no judgment ID."""
    from starlette.routing import Match

    from kiln.serving.path_params import path_param_patterns

    def leaves(routes):  # FastAPI keeps an included router as one entry (``original_router``); Kiln's
        for route in routes:  # routers are included without a prefix, so their routes match the scope as is
            inner = getattr(route, "original_router", None)
            yield from leaves(inner.routes) if inner is not None else (route,)

    methods: set[str] = set()
    for route in leaves(app.router.routes):
        route_methods: set[str] = set(getattr(route, "methods", None) or ())
        match, child = route.matches(scope) if route_methods else (Match.NONE, {})
        if match not in (Match.FULL, Match.PARTIAL):
            continue
        values = child.get("path_params", {})  # a parameter that can never be this segment: not this path's route
        if all(p.fullmatch(str(values.get(name, ""))) for name, p in path_param_patterns(route).items()):
            methods |= route_methods
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI, redact: Callable[[str], str] = str) -> None:
    """Map every exception to the envelope; ``redact`` keeps server paths out of messages."""

    @app.exception_handler(KilnError)
    async def _kiln_error(_request: Request, exc: KilnError) -> JSONResponse:
        return kiln_error_response(exc, redact)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:  # Starlette names only the first route whose path matched
            exc.headers = {**(exc.headers or {}), "Allow": allowed_methods(app, request.scope)}
        return http_error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return unexpected_error_response(exc)
