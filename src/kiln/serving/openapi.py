"""The published OpenAPI document: every status each route can answer, with its body schema.

FastAPI generates the document from the routes; :func:`install_openapi` then
completes it from :data:`ROUTE_DOCS` (route -> success model and statuses), so
``/openapi.json`` and ``/docs`` say what the server really sends:

* the success body's model (routes build dicts for speed, so their own return
  annotations say little), and ``text/event-stream`` with the event model for the
  streaming routes (``x-kiln-event-schema``);
* every error status the route can return, each with :class:`ErrorResponse`;
  FastAPI's default 422 is removed (validation errors are 400 here);
* the statuses the security middleware adds: 401 (``server.api_key_env`` set),
  403 (Host or Origin refused), and on state-changing routes 408 (body too slow),
  413 (body too large) and 415 (wrong Content-Type).

Component schemas are generated in pydantic's *validation* mode: a response is
valid when a client's validation of it succeeds (fields with a default, such as
the ``usage`` of a stream event, may be absent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kiln.serving import openai_responses as oai
from kiln.serving import protocol as p
from kiln.serving.openapi_bounds import RuntimeBounds, apply_runtime_bounds

REF = "#/components/schemas/{model}"

STATUS_TEXT = {
    400: "invalid request (schema, limits, JSON)", 401: "missing or wrong API key (server.api_key_env set)",
    403: "Host or Origin not allowed", 404: "unknown model, adapter, job or route",
    408: "request body not received within server.body_timeout_s", 409: "conflict with the current state",
    413: "body over the configured limit", 415: "unsupported Content-Type",
    429: "overloaded: queue full (Retry-After)", 500: "server fault in stored state", 503: "unavailable (Retry-After)",
    507: "can never fit in the memory budget (limits.memory_budget_bytes)",
}
STATE_CHANGING = frozenset({"post", "put", "patch", "delete"})


@dataclass(frozen=True)
class RouteDoc:
    model: type[BaseModel] | None  # success body (JSON); None: `media` below
    errors: tuple[int, ...]
    status: int = 200
    stream_event: type[BaseModel] | None = None
    media: str | None = None  # success media type of a non-JSON body
    request_media: str | None = None  # raw request body the route reads itself (not a pydantic model)


_GENERATION_ERRORS = (400, 404, 429, 503)


def _teacher_docs() -> dict[tuple[str, str], RouteDoc]:
    from kiln.serving.routes_teachers import TeacherInfo, TeacherList, TeacherManifestInfo

    return {
        # 404: credential_id names no configured credential (unknown_credential), or a local teacher's adapter is
        # not loaded; 409: alias exists or the teacher's answer breaks the identity contract; 413: answer over the
        # byte cap; 503: teacher unreachable or its credential unusable.
        ("post", "/v1/teachers"): RouteDoc(TeacherInfo, (400, 404, 409, 413, 503), status=201),
        ("get", "/v1/teachers"): RouteDoc(TeacherList, (503,)),
        ("get", "/v1/teachers/{alias}"): RouteDoc(TeacherInfo, (404, 503)),
        ("delete", "/v1/teachers/{alias}"): RouteDoc(TeacherInfo, (404, 503)),
        # 404: `model` names no loaded adapter; 409: this server does not act as a teacher
        ("get", "/v1/teacher/manifest"): RouteDoc(TeacherManifestInfo, (404, 409, 503)),
    }
def _openenv_docs() -> dict[tuple[str, str], RouteDoc]:
    from kiln.openenv.schemas import OpenEnvPreflight, OpenEnvRun, OpenEnvRunList

    return {
        # 400: invalid request or training field (preflight; nothing persisted); 404: base_adapter unknown;
        # 409: adapter conflict or idempotency_key reused with another request; 429: [openenv] max_tracked_runs reached (Retry-After); 503: training disabled.
        ("post", "/v1/openenv/runs"): RouteDoc(OpenEnvRun, (400, 404, 409, 429, 503), status=202),
        ("get", "/v1/openenv/runs"): RouteDoc(OpenEnvRunList, ()),
        ("get", "/v1/openenv/runs/{run_id}"): RouteDoc(OpenEnvRun, (404,)),
        # 409: the run is already succeeded, failed or cancelled.
        ("post", "/v1/openenv/runs/{run_id}/cancel"): RouteDoc(OpenEnvRun, (404, 409)),
        # 400/404/409/503 as for starting a run; 502: the environment breaks the OpenEnv contract; 503: it is down.
        ("post", "/v1/openenv/preflight"): RouteDoc(OpenEnvPreflight, (400, 404, 409, 502, 503)),
        # 404: unknown run or a name not in its artifact manifest; 409: the file no longer matches its digest.
        ("get", "/v1/openenv/runs/{run_id}/artifacts/{name}"): RouteDoc(None, (404, 409),
                                                                       media="application/octet-stream"),
    }


def _judgment_docs() -> dict[tuple[str, str], RouteDoc]:
    from kiln.judgments import schemas as j

    return {
        ("post", "/v1/judgments"): RouteDoc(j.Judgment, (400, 503), status=201),
        # 404: `after` names no stored judgment.
        ("get", "/v1/judgments"): RouteDoc(j.JudgmentList, (400, 404, 503)),
        ("get", "/v1/judgments/export"): RouteDoc(None, (503,), media="application/x-ndjson"),
        ("get", "/v1/judgments/{judgment_id}"): RouteDoc(j.Judgment, (404, 503)),
        # 400: a training field or judgments that do not fit an SFT request; 403: stable profile; 409: too few
        # judgments stored (too_few_judgments); 404/409/503 as for POST /v1/train/sft.
        ("post", "/v1/judgments/train"): RouteDoc(j.JudgeTrainResponse, (400, 403, 404, 409, 503), status=202),
        # 400: prompt too long; 404: the judge is not loaded (judge_not_loaded); 409: the tokenizer cannot answer
        # with one letter; 429: the engine's queue stayed full; 503: the judge did not answer in time.
        ("post", "/v1/judgments/compare"): RouteDoc(j.CompareResponse, (400, 404, 409, 429, 503)),
    }


def _eval_docs() -> dict[tuple[str, str], RouteDoc]:
    """``/v1/evals/*``: 404 an unknown suite, dataset, run or adapter; 409 a state conflict (a suite that
    exists, a run still going); 413 a suite or import over its limits; 503 the eval worker is down."""
    docs = {("post", f"/v1/evals/{kind}"): RouteDoc(None, (400, 404, 409, 413, 503), status=202)
            for kind in ("runs", "comparisons", "replays", "gate")}
    for path in ("/v1/evals/suites", "/v1/evals/suites/import"):
        docs[("post", path)] = RouteDoc(None, (400, 404, 409, 413, 503), status=201)
    for method, path in (("get", "/v1/evals/suites"), ("get", "/v1/evals/runs")):
        docs[(method, path)] = RouteDoc(None, (503,))
    for method, path in (("get", "/v1/evals/suites/{name}"), ("delete", "/v1/evals/suites/{name}"),
                         ("get", "/v1/evals/runs/{run_id}"), ("delete", "/v1/evals/runs/{run_id}")):
        docs[(method, path)] = RouteDoc(None, (404, 409, 503))
    return docs


ROUTE_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("post", "/v1/chat/completions"): RouteDoc(oai.ChatCompletionResponse, _GENERATION_ERRORS,
                                               stream_event=oai.ChatCompletionChunk),
    ("post", "/v1/completions"): RouteDoc(oai.CompletionResponse, _GENERATION_ERRORS, stream_event=oai.CompletionChunk),
    ("post", "/v1/completions/batch"): RouteDoc(oai.BatchCompletionResponse, _GENERATION_ERRORS),
    ("get", "/v1/models"): RouteDoc(oai.ModelList, ()),
    ("post", "/tokenize"): RouteDoc(oai.TokenizeResponse, (400, 404)),
    ("post", "/detokenize"): RouteDoc(oai.DetokenizeResponse, (400, 404)),
    ("get", "/health"): RouteDoc(p.HealthResponse, (503,)),
    ("get", "/metrics"): RouteDoc(None, (), media="text/plain"),
    ("get", "/v1/config"): RouteDoc(p.ConfigResponse, ()),
    ("post", "/v1/train/sft"): RouteDoc(p.TrainingJob, (400, 404, 409, 503, 507), status=202),
    ("post", "/v1/train/grpo"): RouteDoc(p.TrainingJob, (400, 404, 409, 503, 507), status=202),
    ("get", "/v1/train/status"): RouteDoc(p.TrainingStatus, (503,)),
    ("get", "/v1/train/jobs/{job_id}"): RouteDoc(p.TrainingJob, (404, 503)),
    ("delete", "/v1/train/queue/{job_id}"): RouteDoc(p.TrainingJob, (404, 409, 503)),
    ("get", "/v1/adapters"): RouteDoc(p.AdapterList, (500,)),
    ("get", "/v1/adapters/{name}"): RouteDoc(p.AdapterDetail, (400, 404, 500)),
    ("post", "/v1/adapters/{name}/load"): RouteDoc(p.AdapterLoaded, (400, 404, 409, 500, 503, 507)),
    ("post", "/v1/adapters/{name}/unload"): RouteDoc(p.AdapterUnloaded, (400, 404)),
    ("delete", "/v1/adapters/{name}"): RouteDoc(p.AdapterDeleted, (400, 404, 409, 500)),
    ("get", "/v1/adapters/{name}/receipt"): RouteDoc(p.TrainingReceipt, (400, 404, 500)),
    ("get", "/v1/adapters/{name}/download"): RouteDoc(None, (400, 404, 500), media="application/gzip"),
    ("post", "/v1/adapters/{name}/upload"): RouteDoc(p.AdapterInfo, (400, 409, 429, 500), status=201,
                                                     request_media="application/gzip"),
    ("post", "/v1/adapters/merge"): RouteDoc(p.AdapterMerged, (400, 404, 409, 500), status=201),
    ("get", "/v1/adapters/default"): RouteDoc(None, ()),
    ("put", "/v1/adapters/default"): RouteDoc(None, (400, 404, 409, 500, 503, 507)),
    # diagnostics (docs/latency.md): 404 while server.debug_requests / server.debug_model_state is off
    ("get", "/v1/debug/requests"): RouteDoc(None, (400, 404)),
    ("get", "/v1/debug/model-state"): RouteDoc(None, (404,)),
    ("post", "/v1/adapters/{name}/quarantine/clear"): RouteDoc(None, (400, 404, 500)),
    ("delete", "/v1/adapters/default"): RouteDoc(None, ()),
    ("post", "/v1/train/opd"): RouteDoc(p.TrainingJob, (400, 404, 409, 503, 507), status=202),
    ("post", "/v1/train/kd"): RouteDoc(p.TrainingJob, (400, 404, 409, 503, 507), status=202),
    **_teacher_docs(),
    **_openenv_docs(),
    **_eval_docs(),
    **_judgment_docs(),
}


def _component_schemas() -> dict[str, Any]:
    models: set[type[BaseModel]] = {oai.ErrorResponse}
    for doc in ROUTE_DOCS.values():
        models |= {m for m in (doc.model, doc.stream_event) if m is not None}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template=REF)
    return defs.get("$defs", {})


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _error_response(status: int) -> dict[str, Any]:
    return {"description": STATUS_TEXT.get(status, "error"),
            "content": {"application/json": {"schema": _ref(oai.ErrorResponse)}}}


def complete_operation(method: str, path: str, op: dict[str, Any]) -> None:
    """Rewrite one operation's ``responses`` from :data:`ROUTE_DOCS` and the middleware's statuses."""
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    doc = ROUTE_DOCS.get((method, path))
    if doc is not None and doc.request_media is not None:
        binary = {"schema": {"type": "string", "format": "binary"}}
        op["requestBody"] = {"required": True, "content": {doc.request_media: binary,
                                                           "application/octet-stream": binary}}
    statuses = {400, 403} if path == "/health" else {400, 401, 403}  # 400: no single Host header (middleware)
    has_input = bool(op.get("parameters")) or "requestBody" in op
    if has_input:
        statuses.add(400)
    if any(param.get("in") == "path" for param in op.get("parameters", ())):
        statuses.add(404)  # no such resource
    if method in STATE_CHANGING:
        statuses |= {408, 413, 415}
    if doc is not None:
        statuses |= set(doc.errors)
        ok = responses.pop("200", None) or responses.pop(str(doc.status), None) or {"description": "OK"}
        if doc.model is not None:
            ok["content"] = {"application/json": {"schema": _ref(doc.model)}}
        elif doc.media is not None:
            ok["content"] = {doc.media: {"schema": {"type": "string"}}}
        if doc.stream_event is not None:
            ok["content"]["text/event-stream"] = {
                # OpenAPI 3.1: `schema` describes one event; its `data` is the event model's JSON, or
                # `[DONE]` last. `x-kiln-event-schema` names that model (the docs and the tests use it).
                "schema": {"type": "object", "required": ["data"], "properties": {
                    "data": {"type": "string", "contentMediaType": "application/json",
                             "description": f"a {doc.stream_event.__name__} as JSON, or [DONE] (the last event)"},
                    "event": {"type": "string"}, "id": {"type": "string"}}},
                "x-kiln-event-schema": _ref(doc.stream_event),
            }
            ok["description"] = "JSON, or an SSE stream of events when stream is true"
        responses[str(doc.status)] = ok
    for status in sorted(statuses):
        responses.setdefault(str(status), _error_response(status))
    op["responses"] = dict(sorted(responses.items()))


# Whole request bodies the docs show (with the served model's ``model``): one per kind of use,
# so "try it out" and API fuzzers (their examples phase) reach the engine, not only the validators.
REQUEST_EXAMPLES: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("post", "/v1/chat/completions"): {
        "chat": {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8},
        "json_schema": {"messages": [{"role": "user", "content": "A city as JSON"}], "max_tokens": 24,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
                            "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                            "required": ["name"]}}}},
        "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 24,
                  "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                      "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}],
                  "tool_choice": "required", "parallel_tool_calls": False},
    },
    ("post", "/v1/completions"): {
        "completion": {"prompt": "The river", "max_tokens": 8, "presence_penalty": 0.5},
        "batch": {"prompt": ["The river", "Once upon"], "max_tokens": 4, "echo": True, "logprobs": 1},
    },
    ("post", "/v1/completions/batch"): {
        "batch": {"prompts": ["The river", [5, 6, 7]], "max_tokens": 4, "n": 2},
    },
}


def install_openapi(app: FastAPI, model_id: str | None = None, bounds: RuntimeBounds | None = None) -> None:
    """Replace ``app.openapi`` with the completed document (generated once, then cached).

    ``model_id`` (the served model) becomes the example of every request's ``model``
    field, so the docs' "try it out" and API fuzzers start from a request that runs;
    ``bounds`` (the configured limits, the context and the vocabulary) tighten the request
    schemas (:mod:`kiln.serving.openapi_bounds`).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            components.update(_component_schemas())
            if bounds is not None:
                apply_runtime_bounds(components, bounds)
            if model_id is not None:
                for name in ("ChatCompletionRequest", "CompletionRequest"):
                    model_field = components.get(name, {}).get("properties", {}).get("model")
                    if model_field is not None:
                        model_field["examples"] = [model_id]
            for path, item in schema.get("paths", {}).items():
                for method, op in item.items():
                    complete_operation(method, path, op)
                    if model_id is not None and (method, path) in REQUEST_EXAMPLES:
                        body = op.get("requestBody", {}).get("content", {}).get("application/json")
                        if body is not None:
                            body["examples"] = {name: {"value": {"model": model_id, **value}}
                                                for name, value in REQUEST_EXAMPLES[(method, path)].items()}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

