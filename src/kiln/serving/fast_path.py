"""Pure-ASGI dispatch of the generation routes, ahead of FastAPI's per-request machinery.

FastAPI spends more event-loop CPU on a request (its middleware layers, routing,
dependency solving, content-type parsing, telemetry hooks) than Kiln spends on
rendering, tokenizing and admitting it; with many requests arriving together
they are parsed one after another on the single loop, which is what stretches
the time to first token under concurrency. :class:`FastRoutes` serves the
common case itself: a ``POST`` to one of the routes it is given, with
``Content-Type: application/json``, whose body parses and validates. It reads
the body through the ``receive`` it was handed (so the body-limit middleware
outside it still bounds it), validates it with the same pydantic model FastAPI
would, and calls the same handler the FastAPI route calls.

Each generation route is declared once, with :meth:`GenerationRoutes.post`: that registers
it on the module's FastAPI router (for the OpenAPI schema and the requests the fast path hands
on) and in the table :class:`FastRoutes` serves, so the two dispatchers cannot drift apart.

Everything else goes to FastAPI unchanged, with the body messages already read
replayed in order: other paths and methods, other content types, a body that is
not JSON or does not validate, a client that leaves while the body is read. So
FastAPI's validation errors, 404/405 and redirects stay the contract, and the
fast path only ever answers requests FastAPI would have passed to the handler.
Errors the handler raises get the same envelopes as the app's exception handlers.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
from typing import Any, Awaitable, Callable, NamedTuple

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.errors import InvalidRequest, KilnError
from kiln.serving.errors import (
    http_error_response,
    kiln_error_response,
    unexpected_error_response,
)

Handler = Callable[[Any, Any, Receive], Awaitable[Response]]
Precheck = Callable[[Any, Any], None]  # (state, the parsed JSON) -> raises a KilnError before validation


class FastRoute(NamedTuple):
    model: type[BaseModel]  # the request body's pydantic model
    handler: Handler  # await handler(state, validated request, receive) -> the response
    precheck: Precheck | None  # sees the parsed JSON before validation (a count limit), or None

PARSE_OFF_LOOP_BYTES = 256 << 10  # bodies larger than this are parsed and validated on a worker thread

JSON_MEDIA_TYPE = b"application/json"
MAX_JSON_DEPTH = 64  # nesting levels of arrays/objects; Kiln's request schemas need fewer than 10


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``body`` nests arrays/objects deeper than ``limit`` (brackets inside strings are
    skipped). Cheap: bodies with at most ``limit`` opening brackets in all are never scanned."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte == 0x5B or byte == 0x7B:  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte == 0x5D or byte == 0x7D:  # ] }
            depth -= 1
    return False


def is_json_content(headers: list[tuple[bytes, bytes]]) -> bool:
    """True when the first ``Content-Type`` header is plain ``application/json`` (any parameters)."""
    for name, value in headers:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == JSON_MEDIA_TYPE
    return False


def replaying(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then defers to ``receive``."""
    pending = collections.deque(messages)

    async def replay() -> Message:
        if pending:
            return pending.popleft()
        return await receive()

    return replay


class GenerationRoutes:
    """The generation routes of one module, each declared once (``@routes.post(...)`` on its handler).

    ``router`` (a FastAPI ``APIRouter``) gets a thin endpoint per route that calls the same handler
    with the app's state; :attr:`table` is what :class:`FastRoutes` serves.
    """

    def __init__(self, router: Any):
        self.router = router
        self.table: dict[str, FastRoute] = {}

    def post(self, path: str, model: type[BaseModel], *, name: str, response_model: type[BaseModel],
             precheck: Precheck | None = None) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            async def endpoint(body: Any, request: Request) -> Response:
                return await handler(request.app.state.kiln, body, request.receive)

            # FastAPI reads the body's model (and the schema it documents) from the signature
            endpoint.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
                inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=model),
                inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
            ], return_annotation=Response)
            self.router.add_api_route(path, endpoint, methods=["POST"], name=name, response_model=response_model)
            self.table[path] = FastRoute(model, handler, precheck)
            return handler

        return register


class FastRoutes:
    """Serve ``routes`` (path -> :class:`FastRoute`) directly; hand anything else to ``app``.

    A handler is called as ``await handler(state, validated_request, receive)`` and
    returns the response to send. A precheck sees the parsed JSON before the model validates it,
    so a count limit refuses a huge body before pydantic builds it (a KilnError it raises is the
    answer). Bodies over ``PARSE_OFF_LOOP_BYTES`` are parsed and validated off the event loop.
    """

    def __init__(self, app: ASGIApp, state: Any, routes: dict[str, FastRoute]):
        self.app = app
        self.state = state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not is_json_content(scope["headers"]):
            return await self.app(scope, receive, send)
        messages: list[Message] = []
        chunks: list[bytes] = []
        try:
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":  # the client left mid-body: FastAPI's behaviour
                    return await self.app(scope, replaying(messages, receive), send)
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except HTTPException as exc:  # the body-limit middleware refusing a chunked body mid-stream
            return await http_error_response(exc)(scope, receive, send)
        model, handler, precheck = route
        body = b"".join(chunks)
        if json_depth_exceeds(body):  # json.loads would recurse into a RecursionError (a 500)
            error = InvalidRequest(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels",
                                   code="invalid_json", hint="flatten the request body")
            return await kiln_error_response(error)(scope, receive, send)
        off_loop = len(body) > PARSE_OFF_LOOP_BYTES
        try:
            data = await asyncio.to_thread(json.loads, body) if off_loop else json.loads(body)
        except ValueError:  # not JSON (JSONDecodeError, UnicodeDecodeError): FastAPI's answer
            return await self.app(scope, replaying(messages, receive), send)
        if precheck is not None:
            try:
                precheck(self.state, data)
            except KilnError as exc:
                return await kiln_error_response(exc)(scope, receive, send)
        try:
            request = await asyncio.to_thread(model.model_validate, data) if off_loop else model.model_validate(data)
        except ValidationError:
            return await self.app(scope, replaying(messages, receive), send)
        try:
            response = await handler(self.state, request, receive)
        except KilnError as exc:
            response = kiln_error_response(exc)
        except HTTPException as exc:
            response = http_error_response(exc)
        except Exception as exc:
            response = unexpected_error_response(exc)
        await response(scope, receive, send)
