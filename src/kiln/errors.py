"""Kiln's one error model: :class:`KilnError` and its status classes.

Every layer (runtime, training, adapters, serving) raises a :class:`KilnError`
subclass carrying a stable machine ``code``, a ``message`` that says what was
wrong, a ``hint`` that says what to do, and the status class it belongs to.
Only :mod:`kiln.serving.errors` turns it into HTTP (the OpenAI error envelope);
the CLI prints it as one line. This module is standard-library only so every
layer, pure contract modules included, can import it.

Status classes follow what OpenAI and vLLM clients expect:

=====================  ======  =========================
class                  status  OpenAI ``type``
=====================  ======  =========================
:class:`InvalidRequest`  400   ``invalid_request_error``
:class:`Unauthorized`    401   ``authentication_error``
:class:`Forbidden`       403   ``permission_error``
:class:`NotFound`        404   ``not_found_error``
:class:`Conflict`        409   ``conflict_error``
:class:`PayloadTooLarge` 413   ``invalid_request_error``
:class:`RateLimited`     429   ``rate_limit_error``
:class:`Internal`        500   ``internal_error``
:class:`Unavailable`     503   ``service_unavailable_error``
:class:`InsufficientMemory` 507 ``insufficient_memory_error``
=====================  ======  =========================
"""

from __future__ import annotations

from typing import ClassVar

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable_error",
    507: "insufficient_memory_error",
}


def error_type(status: int) -> str:
    """The OpenAI ``error.type`` for an HTTP status."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "internal_error"


class KilnError(Exception):
    """Base of every error Kiln raises on purpose.

    Subclasses set the class attributes ``status``, ``code`` and ``default_hint``;
    a call site may override ``code`` and ``hint`` and name the offending request
    field in ``param``. ``retry_after`` (seconds) is sent as ``Retry-After`` for
    429/503.
    """

    status: ClassVar[int] = 500
    code: str = "kiln_error"
    default_hint: ClassVar[str] = ""

    def __init__(self, message: str, *, code: str | None = None, hint: str | None = None,
                 param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.hint = hint if hint is not None else self.default_hint
        self.param = param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return error_type(self.status)

    def one_line(self) -> str:
        """``code: message (hint)`` for a CLI."""
        hint = f" ({self.hint})" if self.hint else ""
        return f"{self.code}: {self.message}{hint}"


class InvalidRequest(KilnError):
    status = 400
    code = "invalid_request"


class Unauthorized(KilnError):
    status = 401
    code = "unauthorized"


class Forbidden(KilnError):
    status = 403
    code = "forbidden"


class NotFound(KilnError):
    status = 404
    code = "not_found"


class Conflict(KilnError):
    status = 409
    code = "conflict"


class PayloadTooLarge(KilnError):
    status = 413
    code = "payload_too_large"


class RateLimited(KilnError):
    status = 429
    code = "overloaded"


class ClientClosed(KilnError):
    """The client went away before the answer was ready (nginx's 499; nobody reads the body)."""

    status = 499
    code = "client_closed"


class Internal(KilnError):
    """A fault of the server or its stored state, never of the caller's input."""

    status = 500
    code = "internal_error"


class Unavailable(KilnError):
    status = 503
    code = "unavailable"


class InsufficientMemory(KilnError):
    """The work can never fit in this server's memory budget, whatever else is released (507)."""

    status = 507
    code = "insufficient_memory"


STATUS_CLASSES: dict[int, type[KilnError]] = {
    cls.status: cls
    for cls in (InvalidRequest, Unauthorized, Forbidden, NotFound, Conflict, PayloadTooLarge, RateLimited,
                Internal, Unavailable, InsufficientMemory)
}


def error_for_status(status: int, message: str, *, code: str | None = None, hint: str | None = None,
                     param: str | None = None, retry_after: float | None = None) -> KilnError:
    """A :class:`KilnError` of the status class for ``status`` (for translating a foreign status)."""
    cls = STATUS_CLASSES.get(status, InvalidRequest if 400 <= status < 500 else Internal)
    return cls(message, code=code, hint=hint, param=param, retry_after=retry_after)
