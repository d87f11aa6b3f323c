"""Kiln's error envelope ``{"error": {"code", "message", "hint"}}`` for every failure.

:class:`APIError` is what route code raises; the handlers installed by
:func:`install_error_handlers` also rewrite FastAPI's validation errors (422,
or 400 for a body that is not JSON), unknown routes/methods, and unexpected
exceptions (500, logged) into the same envelope.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kiln.serving")

MAX_VALIDATION_PROBLEMS = 10


class APIError(Exception):
    def __init__(self, status: int, code: str, message: str, hint: str = ""):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.hint = hint


def error_body(code: str, message: str, hint: str = "") -> dict:
    return {"error": {"code": code, "message": message, "hint": hint}}


def error_response(status: int, code: str, message: str, hint: str = "", headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message, hint), status_code=status, headers=headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 400: "bad_request"}


def api_error_response(exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.hint)


def http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    hint = "see GET /docs for the available endpoints" if exc.status_code in (404, 405) else ""
    return error_response(exc.status_code, code, str(exc.detail), hint, headers=getattr(exc, "headers", None))


def unexpected_error_response(exc: Exception) -> JSONResponse:
    """A 500 for a bug; logs the traceback (call it inside the ``except`` block)."""
    log.exception("unhandled error")
    return error_response(500, "internal_error", f"internal error: {type(exc).__name__}",
                          "this is a server bug; the server log has the traceback")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "invalid_json", "the request body is not valid JSON",
                                  "send a JSON object with Content-Type: application/json")
        problems = []
        for err in errors[:MAX_VALIDATION_PROBLEMS]:
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{loc}: {err.get('msg', 'invalid')}")
        more = f" (+{len(errors) - MAX_VALIDATION_PROBLEMS} more)" if len(errors) > MAX_VALIDATION_PROBLEMS else ""
        return error_response(422, "invalid_request", "; ".join(problems) + more,
                              "fix the listed fields; see GET /docs for the request schema")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return unexpected_error_response(exc)
