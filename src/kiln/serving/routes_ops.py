"""Operator endpoints: GET /health, GET /metrics, GET /v1/config; and per-request metrics."""

from __future__ import annotations

import os
import resource
import sys
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.errors import NotFound
from kiln.runtime import request_trace
from kiln.runtime.request_trace import RequestTrace
from kiln.serving import default_adapter
from kiln.serving.request_log import NOT_LOGGED
from kiln.serving.output_parser import reasoning_parser, tool_parser
from kiln.serving.state import base_representation

router = APIRouter()

OTHER_ENDPOINT = "other"  # label for paths that match no route (bounds metric cardinality)


def _memory(state) -> dict:
    stats = state.engine.stats()
    out: dict = {"kv_cache_bytes": stats["kv_cache_bytes"], "kv_used_bytes": stats.get("kv_used_bytes", 0),
                 "kv_workspace_bytes": stats.get("kv_workspace_bytes", 0)}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peak_rss_bytes"] = peak if sys.platform == "darwin" else peak * 1024
    if str(state.model.device).startswith("cuda"):
        import torch

        out["accelerator_allocated_bytes"] = torch.cuda.memory_allocated()
        out["accelerator_reserved_bytes"] = torch.cuda.memory_reserved()
    return out


def _family(state) -> dict | None:
    family = getattr(state.model, "family", None)
    return family.as_dict() if family is not None else None


def _quantization(state) -> dict:
    report = getattr(state.model, "quantization", None)
    if report is not None:
        return report.as_dict()
    return {"requested": state.settings.model.quantize, "effective": base_representation(state.model),
            "kernel": None, "probe_kl": None}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state.kiln
    engine = state.engine
    stats = engine.stats()
    ok, why = engine.health()  # not ok: stopped, failed, or stuck in one step past batching's stall timeout
    body = {
        "status": "ok" if ok else "unavailable",
        "model": state.model_id,
        "base_model_sha256": state.model.base_model_sha256,
        "backend": getattr(engine, "backend", "hf"),  # hf (built-in engine) | vllm
        **({"vllm": engine.describe()} if hasattr(engine, "describe") else {}),
        "device": state.model.device,
        "dtype": state.model.dtype,
        # float32 | bfloat16 | float16 | int8 | int4: the base weights as served (model.quantize; docs/serving.md)
        "base_representation": base_representation(state.model),
        # kind (attention | hybrid), architecture, and whether only a multimodal checkpoint's language model runs
        "model_family": _family(state),
        "uptime_s": round(time.time() - state.started_at, 3),
        "queued_rows": stats["queued_rows"],
        "active_rows": stats["active_rows"],
        "max_running_rows": stats["max_running_rows"],
        "queue_oldest_wait_s": stats.get("queue_oldest_wait_s", 0.0),
        # each waiting row (first QUEUE_DETAIL_MAX): position, seconds waited, prompt tokens, kind
        "queue": stats.get("queue", []),
        "queue_blocked_on": stats.get("queue_blocked_on"),  # kv_budget | running_rows | token_budget | None
        "kv_blocks": {k[len("kv_blocks_"):]: stats[k] for k in ("kv_blocks_total", "kv_blocks_used",
                                                                "kv_blocks_cached", "kv_blocks_free") if k in stats}
        | {"block_size": stats.get("kv_block_size", 0), "preemptions": stats.get("preemptions", 0),
           "prefix_hit_blocks": stats.get("prefix_cache_hit_blocks", 0)},
        # a hybrid's per-row Gated DeltaNet state slots and its prefix cache's state snapshots (None for
        # all-attention models)
        "linear_state": {k[len("linear_state_"):]: stats[k] for k in ("linear_state_slots_total",
                                                                      "linear_state_slots_used", "linear_state_bytes")}
        | {k[len("linear_"):]: stats[k] for k in ("linear_snapshots", "linear_snapshots_max", "linear_snapshot_hits",
                                                  "linear_snapshot_evictions") if k in stats}
        # what runs its Gated DeltaNet functions: requested, effective, per function, why (kiln.runtime.linear_kernels)
        | {"kernels": stats.get("linear_kernels")}
        if "linear_state_slots_total" in stats else None,
        "engine_error": why,
        # once a cycle failure latched the engine (unknown completion state): {class, reason}; restart the server
        "restart_required": stats.get("restart_required"),
        # cycle failures contained to their rows so far, by class (forward_error, out_of_memory)
        "engine_faults": stats.get("cycle_faults", {}),
        "engine_busy_s": stats.get("busy_s"),
        "engine_steps": stats["steps"],
        "engine_step_cost": stats.get("step_cost"),  # the fitted cycle cost: fixed_ms, per_token_ms, steps
        # prompt-only cycles on more torch threads (model.prefill_threads; None: never) and how many ran so far
        "engine_prefill": {"threads": stats.get("prefill_threads"), "wide_steps": stats.get("wide_prefill_steps", 0)},
        "admitting": stats.get("admitting", 0),  # requests being parsed and rendered, not yet submitted
        "adapters": engine.active_adapters(),
        # served before the last restart but not restored (deleted, no longer verifying, another base): why
        "adapters_not_restored": state.adapters_not_restored,
        # why the saved served set (<adapters>/.served.json) was ignored at start-up or cannot be written
        "served_set_error": state.served.problem if state.served is not None else None,
        "default_adapter": default_adapter.describe(state)["default"],  # requests naming the base model get it
        "ownership": engine.ownership.snapshot(),
        "training_attached": state.trainer is not None,
        "memory": _memory(state),
        # memory admission (docs/serving.md): budget, resident weights and KV, reservations (training, adapters)
        "memory_budget": state.memory.snapshot() if state.memory is not None else None,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.kiln.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/config")
async def config(request: Request) -> JSONResponse:
    state = request.app.state.kiln
    loaded = state.loaded_settings
    return JSONResponse({
        "config_file": str(loaded.config_file) if loaded.config_file else None,
        "settings": loaded.effective(),
        # What the server actually enforces where it differs from a setting (e.g. the model's own length cap).
        "effective": {
            "profile": state.settings.serving.profile,  # stable: serving only (docs/serving.md)
            "training_enabled": state.trainer is not None,
            "max_model_len": state.engine.config.max_model_len,
            "model_max_position_embeddings": state.model.max_model_len,
            # batching.prefix_cache as requested and as used (off for hybrid models: docs/serving.md, "Model families")
            "prefix_cache": getattr(state.engine, "prefix_cache", None),
            # batching.compile_decode as requested and as used (a bucket that fails to compile turns it off)
            "compile_decode": getattr(state.engine, "compile_decode", None),
            # serving.tool_call_parser / reasoning_parser as resolved (auto: by the chat template's family)
            "tool_call_parser": tool_parser(state).name,
            "reasoning_parser": getattr(reasoning_parser(state), "name", None),
            # model.quantize as requested and as done: representation, kernel, bytes, the probe KL (nats)
            "quantization": _quantization(state),
        },
    })


@router.get("/v1/debug/requests")
async def debug_requests(request: Request, limit: int | None = None) -> JSONResponse:
    """The recent-request log (``server.debug_requests`` entries, newest last); 404 when it is off."""
    log = getattr(request.app.state, "request_log", None)
    if log is None:
        raise NotFound("the recent-request log is off", code="debug_requests_disabled",
                       hint="start the server with server.debug_requests = N (KILN_SERVER_DEBUG_REQUESTS)")
    if limit is not None and not 0 <= limit <= log.capacity:
        from kiln.errors import InvalidRequest

        raise InvalidRequest(f"limit must be in [0, {log.capacity}]", code="invalid_limit", param="limit")
    return JSONResponse(log.snapshot(limit))


@router.get("/v1/debug/model-state")
async def debug_model_state(request: Request) -> JSONResponse:
    """The model runtime's state (``server.debug_model_state``; 404 when off): docs/latency.md."""
    state = request.app.state.kiln
    if not state.settings.server.debug_model_state:
        raise NotFound("the debug model-state endpoint is off", code="debug_model_state_disabled",
                       hint="start the server with server.debug_model_state = true (a trusted diagnostic boundary)")
    from kiln.serving.model_state import model_state

    return JSONResponse(model_state(state))


class RequestMetricsMiddleware:
    """Counts every HTTP response by route template and status, and times it to its last byte; with a
    :class:`~kiln.serving.request_log.RequestLog` (``server.debug_requests``) it also records each
    request there, with the phases the engine measured for it."""

    def __init__(self, app, metrics, routes, request_log=None, model_id: str = ""):
        self.app = app
        self.metrics = metrics
        self.request_log = request_log
        self.model_id = model_id
        self._routes = [(r.path_regex, r.path) for r in routes if hasattr(r, "path_regex")]
        self._by_path: dict[str, str] = {}  # path -> endpoint, for paths without parameters

    def _endpoint(self, scope) -> str:
        path = scope.get("path", "")
        name = self._by_path.get(path)
        if name is None:
            name = next((name for regex, name in self._routes if regex.match(path)), OTHER_ENDPOINT)
            if name == path:  # a fixed route: its set of paths is bounded by the app's routes
                self._by_path[path] = name
        return name

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.request_log is not None and scope.get("path") not in NOT_LOGGED:
            return await self._logged(scope, receive, send)
        return await self._timed(scope, receive, send)

    async def _timed(self, scope, receive, send):
        t0 = time.perf_counter()
        status = 500
        recorded = False

        async def wrapped(message):
            nonlocal status, recorded
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not recorded:
                recorded = True
                self.metrics.record_request(self._endpoint(scope), status, time.perf_counter() - t0)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            if not recorded:  # client went away mid-response, or the app failed
                self.metrics.record_request(self._endpoint(scope), status, time.perf_counter() - t0)

    async def _logged(self, scope, receive, send):
        """:meth:`_timed`, recording the request in the recent-request log with the engine's phases."""
        log = self.request_log
        rid = log.request_id(scope.get("headers", []))
        trace = RequestTrace(keep_text=log.keep_text)
        token = request_trace.CURRENT.set(trace)  # Engine.submit attaches it to the request's rows
        started, t0 = time.time(), time.perf_counter()
        status = 500

        async def wrapped(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-kiln-request-id", rid.encode())]}
            await send(message)

        try:
            await self._timed(scope, receive, wrapped)
        finally:
            request_trace.CURRENT.reset(token)
            log.add(rid, scope.get("method", ""), self._endpoint(scope), status, time.perf_counter() - t0, started,
                    trace, self.model_id)
