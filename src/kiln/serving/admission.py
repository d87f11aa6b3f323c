"""A generation request's admission window: open from its arrival until it reaches the engine.

:func:`admitted` wraps a generation route's handler in an engine admission
(``ServingEngine.admission``); :func:`admission_over` ends it when the request's rows are
submitted (:func:`kiln.serving.generation.submit`) or its prompt is scored
(:func:`kiln.serving.prompt_logprobs.score`). An engine waking from idle waits for the
requests still being parsed, prepared and rendered, so a burst shares one first prefill.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from typing import Any, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive

from kiln.runtime.submission import Admission
from kiln.serving.state import KilnState

Handler = Callable[[KilnState, Any, Receive], Awaitable[Response]]

_ADMISSION: contextvars.ContextVar[Admission | None] = contextvars.ContextVar("kiln_admission", default=None)


def admitted(handler: Handler) -> Handler:
    """Run a generation handler as an engine admission until its first submission, or its end.
    The handler first yields once, so the requests the loop read together all open their
    admissions before the first one submits."""

    @functools.wraps(handler)
    async def run(state: KilnState, body: Any, receive: Receive) -> Response:
        admission = state.engine.admission()
        token = _ADMISSION.set(admission)
        try:
            await asyncio.sleep(0)
            return await handler(state, body, receive)
        finally:
            admission.end()
            _ADMISSION.reset(token)

    return run


def admission_over() -> None:
    """The current request reached the engine: its admission ends."""
    admission = _ADMISSION.get()
    if admission is not None:
        admission.end()
