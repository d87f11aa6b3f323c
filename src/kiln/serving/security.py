"""Defences against browsers, exposed ports and slow clients: one pure-ASGI middleware.

:class:`SecurityMiddleware` is the outermost layer of the app (outside the body
limit, the metrics and the generation fast path), so every route is covered. In
order, for each HTTP request:

1. **Host allowlist** (DNS rebinding): the ``Host`` header's name must be
   ``localhost``, a loopback address, the bound address or one of
   ``server.allowed_hosts`` (``*`` accepts any) -> else 403 ``host_not_allowed``.
2. **CORS preflight**: ``OPTIONS`` with ``Access-Control-Request-Method`` gets a
   204 with CORS headers for an origin in ``server.allowed_origins``, else 403.
   CORS is off unless origins are configured.
3. **Bearer token** (optional): when ``server.api_key_env`` names an environment
   variable (read once at start-up), every path except ``/health`` and GETs of the dashboard's
   static shell (``/``, ``/ui``, ``/ui/...``: package files, no data) needs
   ``Authorization: Bearer <key>`` -> else 401 ``unauthorized``.
4. **Origin**: a state-changing request (any method but GET/HEAD/OPTIONS) that
   carries an ``Origin`` must come from the page's own origin or an allowed one
   -> else 403 ``origin_not_allowed``.
5. **Content type**: a state-changing request with a body must be
   ``application/json``, or an archive type for adapter uploads -> else 415
   ``unsupported_media_type``. Browsers can send ``text/plain`` and form bodies
   cross-site without a preflight; they cannot send JSON that way.
6. **Body read deadline**: the whole body must arrive within
   ``server.body_timeout_s`` -> else 408 ``request_timeout`` and the connection
   closes.

uvicorn has no timeout for reading the request head (and, with httptools, no size
limit), so :func:`header_timeout_protocol` subclasses its HTTP protocol to close a
connection whose head is not complete ``server.header_timeout_s`` after it
opened (or after the previous response on a kept-alive connection), and to answer
431 to a head over 64 KiB.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.serving.errors import TrackingSend, send_error

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
OPEN_PATHS = frozenset({"/health"})
# The dashboard's static files hold no data and no secret; a browser must be able to load
# them before it can send the key (the page then adds it to every API call it makes).
OPEN_GET_PREFIXES = ("/ui/",)
OPEN_GET_PATHS = frozenset({"/", "/ui"})
JSON_MEDIA_TYPES = frozenset({"application/json"})
ARCHIVE_MEDIA_TYPES = frozenset({"application/gzip", "application/x-gzip", "application/octet-stream"})
UPLOAD_PATH = re.compile(r"/v1/adapters/[^/]+/upload")
CORS_MAX_AGE_S = 600


def _open_path(method: str, path: str) -> bool:
    """Paths served without the API key: ``/health``, and GETs of the dashboard's static files."""
    if path in OPEN_PATHS:
        return True
    return method in ("GET", "HEAD") and (path in OPEN_GET_PATHS or path.startswith(OPEN_GET_PREFIXES))
CORS_ALLOW_HEADERS = b"authorization, content-type"
MAX_REQUEST_HEAD_BYTES = 64 * 1024  # request line + headers
HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                  b"content-length: 25\r\nconnection: close\r\n\r\nrequest head over 64 KiB\n")


class ApiKeyMissing(RuntimeError):
    """``server.api_key_env`` names a variable that is unset or empty."""


class BodyReadTimeout(HTTPException):
    def __init__(self, limit_s: float):
        super().__init__(408, f"the request body did not arrive within {limit_s:g} s (server.body_timeout_s)")


@dataclass(frozen=True)
class SecurityPolicy:
    allowed_hosts: frozenset[str]  # lower-case host names; "*" accepts any
    allowed_origins: frozenset[str]  # "scheme://host[:port]"
    api_key: str | None
    body_timeout_s: float

    @classmethod
    def from_settings(cls, server, environ=None) -> "SecurityPolicy":
        """Build from ``settings.server``; reads the API key from the named variable once."""
        environ = os.environ if environ is None else environ
        hosts = set(LOOPBACK_HOSTS) | {h.lower() for h in server.allowed_hosts}
        if server.host not in WILDCARD_BINDS:
            hosts.add(server.host.lower().strip("[]"))
        api_key = None
        if server.api_key_env:
            api_key = environ.get(server.api_key_env, "")
            if not api_key:
                raise ApiKeyMissing(f"server.api_key_env names {server.api_key_env}, which is unset or empty; "
                                    f"export {server.api_key_env}=<key> or unset server.api_key_env")
        origins = frozenset(o.rstrip("/").lower() for o in server.allowed_origins)
        return cls(frozenset(hosts), origins, api_key, server.body_timeout_s)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def host_name(host_header: str) -> str:
    """``Host`` value without its port, lower case (``[::1]:80`` -> ``::1``)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def media_type(value: bytes | None) -> str | None:
    if value is None:
        return None
    return value.split(b";", 1)[0].strip().lower().decode("latin-1")


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    if length is not None:
        return length.strip() not in (b"0", b"")
    return _header(scope, b"transfer-encoding") is not None


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, policy: SecurityPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        policy = self.policy
        hosts = [value for key, value in scope["headers"] if key == b"host"]
        if len(hosts) > 1 or (not hosts and scope.get("http_version") not in ("1.0", "0.9")):
            # RFC 9112 3.2: an HTTP/1.1 request without exactly one Host is a 400 (a second one could
            # carry the name the allowlist would refuse)
            return await send_error(send, 400, "invalid_host", f"the request has {len(hosts)} Host headers",
                                    "send exactly one Host header")
        host = hosts[0] if hosts else None
        if host is not None and "*" not in policy.allowed_hosts:
            if host_name(host.decode("latin-1")) not in policy.allowed_hosts:
                return await send_error(send, 403, "host_not_allowed", "this server does not answer to that Host name",
                                    "add the name to server.allowed_hosts (KILN_SERVER_ALLOWED_HOSTS)")
        method = scope["method"]
        origin_raw = _header(scope, b"origin")
        origin = origin_raw.decode("latin-1").rstrip("/").lower() if origin_raw is not None else None
        if method == "OPTIONS" and origin is not None and _header(scope, b"access-control-request-method"):
            return await self._preflight(send, origin)
        if policy.api_key is not None and not _open_path(method, scope["path"]) and not self._authorized(scope):
            return await send_error(send, 401, "unauthorized", "missing or wrong API key",
                                "send Authorization: Bearer <key> (the key is in the variable server.api_key_env names)",
                                extra_headers=[(b"www-authenticate", b"Bearer")])
        if method not in SAFE_METHODS:
            if origin is not None and not self._origin_allowed(origin, host, scope.get("scheme", "http")):
                return await send_error(send, 403, "origin_not_allowed",
                                    f"cross-origin {method} requests from {origin} are refused",
                                    "add the origin to server.allowed_origins to allow it")
            if _has_body(scope):
                allowed = ARCHIVE_MEDIA_TYPES if UPLOAD_PATH.fullmatch(scope["path"]) else JSON_MEDIA_TYPES
                got = media_type(_header(scope, b"content-type"))
                if got not in allowed and not (got is None and allowed is ARCHIVE_MEDIA_TYPES):
                    return await send_error(send, 415, "unsupported_media_type",
                                        f"Content-Type {got or '(none)'} is not accepted here",
                                        f"send the body as {' or '.join(sorted(allowed))}")
        if origin is not None and origin in policy.allowed_origins:
            send = _with_cors(send, origin_raw)
        await self._run(scope, receive, send)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_done = not _has_body(scope)
        timed_out = False
        deadline = asyncio.get_running_loop().time() + self.policy.body_timeout_s

        async def bounded_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                timed_out = True
                raise BodyReadTimeout(self.policy.body_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def closing_send(message: Message) -> None:
            # After a body timeout the rest of the body may still be dribbling in: close the connection.
            if timed_out and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        tracking_send = TrackingSend(closing_send)
        try:
            await self.app(scope, bounded_receive, tracking_send)
        except BodyReadTimeout as exc:
            if not tracking_send.started:
                await send_error(closing_send, 408, "request_timeout", str(exc.detail), "send the whole body promptly")

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or b""
        scheme, _, token = value.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.policy.api_key.encode())

    def _origin_allowed(self, origin: str, host: bytes | None, scheme: str) -> bool:
        if origin in self.policy.allowed_origins:
            return True
        # Same origin: a page this server served itself (the /docs "try it out" button), by the scheme
        # this connection uses (an https page is another origin than this http server)
        return host is not None and origin == f"{scheme}://{host.decode('latin-1').lower()}"

    async def _preflight(self, send: Send, origin: str) -> None:
        if origin not in self.policy.allowed_origins:
            return await send_error(send, 403, "origin_not_allowed", f"cross-origin requests from {origin} are refused",
                                "add the origin to server.allowed_origins to allow it")
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", b"GET, POST, DELETE"),
            (b"access-control-allow-headers", CORS_ALLOW_HEADERS),
            (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
            (b"vary", b"Origin"),
        ]})
        await send({"type": "http.response.body", "body": b""})


def _with_cors(send: Send, origin: bytes) -> Send:
    async def cors_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"access-control-allow-origin", origin), (b"vary", b"Origin")]}
        await send(message)

    return cors_send


def header_timeout_protocol(base: type[asyncio.Protocol], header_timeout_s: float,
                            max_head_bytes: int = MAX_REQUEST_HEAD_BYTES) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol) that bounds the request head in time and size.

    The clock starts when the connection opens and again when a response completes
    (a kept-alive connection waiting for its next request); a connection whose head
    is not complete ``header_timeout_s`` later is closed. A head over
    ``max_head_bytes`` gets a 431 and the connection closes (httptools has no size
    limit of its own). A request whose head completed (uvicorn then has a new
    ``cycle``) is not affected.
    """

    class HeaderTimeoutProtocol(base):  # type: ignore[misc,valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: object = None
        _head_bytes = 0
        _head_tail = b""  # the last bytes of the head so far: its end may span two segments

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_bytes = 0
            self._head_tail = b""
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _waiting_for_head(self) -> bool:
            return self.cycle is self._head_cycle and (self.cycle is None or self.cycle.response_complete)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            # Count the head's bytes before the parser sees them: up to the blank line that ends it
            # (which may arrive in the same segment as the body), all of this data otherwise.
            if self._waiting_for_head() and not self.transport.is_closing():
                seen = self._head_tail + data
                end = seen.find(b"\r\n\r\n")
                head = len(data) if end < 0 else end + 4 - len(self._head_tail)
                if self._head_bytes + head > max_head_bytes:
                    self.transport.write(HEAD_TOO_LARGE)
                    self.transport.close()
                    return
                self._head_bytes += head
                self._head_tail = seen[-3:] if end < 0 else b""
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
