"""The bounded in-memory recent-request log behind ``GET /v1/debug/requests`` (``server.debug_requests``).

Off unless ``server.debug_requests`` = N > 0; then the last N HTTP requests are kept, newest last:
request ID, route template, status, model and adapter revision, seconds per phase (the engine's
``queue_wait``, ``lock_wait``, ``prefill``, ``decode``, measured on the engine thread, and
``total`` to the last response byte), prompt and completion token counts, rows and finish reasons.
Prompt and completion text are kept only with ``server.debug_requests_text`` = true.

:class:`kiln.serving.routes_ops.RequestMetricsMiddleware` opens a :class:`RequestTrace` per request
(the :data:`kiln.runtime.request_trace.CURRENT` context variable), the engine fills it, and the
middleware appends the finished entry here. The request ID is the client's ``x-request-id`` when it
is a short token, else a new one; it is sent back as ``x-kiln-request-id``.
"""

from __future__ import annotations

import collections
import re
import secrets
import threading
from typing import Any, Callable

from kiln.runtime.request_trace import RequestTrace

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
NOT_LOGGED = ("/v1/debug/requests", "/v1/debug/model-state", "/metrics", "/health")  # the log would read itself


class RequestLog:
    """The last ``capacity`` requests (thread-safe append, newest last)."""

    def __init__(self, capacity: int, *, keep_text: bool, decode: Callable[[list[int]], str] | None = None):
        self.capacity = capacity
        self.keep_text = keep_text
        self._decode = decode
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.recorded = 0

    @staticmethod
    def request_id(headers: list[tuple[bytes, bytes]]) -> str:
        for key, value in headers:
            if key == b"x-request-id":
                text = value.decode("latin-1")
                if REQUEST_ID_RE.match(text):
                    return text
        return f"req-{secrets.token_hex(8)}"

    def add(self, request_id: str, method: str, route: str, status: int, total_s: float,
            started_at: float, trace: RequestTrace, model_id: str) -> None:
        entry: dict[str, Any] = {
            "id": request_id, "method": method, "route": route, "status": status,
            "started_at": round(started_at, 3),
            "model": trace.adapter or (model_id if trace.rows else None),
            "adapter": trace.adapter, "adapter_revision": trace.adapter_revision,
            "timings_s": {"total": round(total_s, 6)} | {k: round(v, 6) for k, v in sorted(trace.phases.items())},
            "prompt_tokens": trace.prompt_tokens, "completion_tokens": trace.completion_tokens,
            "rows": trace.rows, "finish_reasons": list(trace.finish_reasons),
        }
        if self.keep_text and self._decode is not None:
            entry["prompt_text"] = self._decode(trace.prompt_ids) if trace.prompt_ids is not None else None
            entry["completion_texts"] = [self._decode(ids) for ids in trace.completion_ids]
        with self._lock:
            self._entries.append(entry)
            self.recorded += 1

    def snapshot(self, limit: int | None = None) -> dict[str, Any]:
        with self._lock:
            entries = list(self._entries)
            recorded = self.recorded
        if limit is not None:
            entries = entries[-limit:] if limit else []
        return {"capacity": self.capacity, "recorded": recorded, "text": self.keep_text, "requests": entries}
