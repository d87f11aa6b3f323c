"""The FastAPI application: ``create_app(loaded_settings, ...)``.

:func:`kiln.serving.state.build_state` is the composition root: it builds the
engine, the one adapter store, the teachers, the evals, the training service and the
OpenEnv service and hands each its dependencies; ``request.app.state.kiln`` is that
typed :class:`KilnState`. The engine starts in the app's lifespan, then the evals, the
training worker and OpenEnv, then the server accepts requests; shutdown stops them in
the reverse order, the engine last, which ends every open row.

ASGI layers, outermost first: security (Host, auth, Origin, Content-Type, body
deadline), body limit, request metrics, the generation fast path, FastAPI.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from kiln.config import LoadedSettings
from kiln.serving.body_limit import BodyLimitMiddleware
from kiln.serving.errors import install_error_handlers
from kiln.serving.openapi import install_openapi
from kiln.serving.openapi_bounds import RuntimeBounds
from kiln.serving.paths import PathRedactor
from kiln.serving.security import SecurityMiddleware, SecurityPolicy
from kiln.serving.state import (  # noqa: F401  (re-exported: build_state is the public entry)
    KilnState,
    build_state,
    restore_served,
    default_fingerprint,
    load_configured_model,
)

__all__ = ["KilnState", "build_state", "create_app", "default_fingerprint", "load_configured_model"]


def create_app(loaded_settings: LoadedSettings, loaded_model=None, *, state: KilnState | None = None) -> FastAPI:
    """Build the app. Pass ``state`` to reuse a prepared one (``kiln serve`` does), else it is built here.

    Raises :class:`kiln.serving.security.ApiKeyMissing` when ``server.api_key_env``
    names an unset variable.
    """
    from kiln.serving import routes_adapters, routes_evals, routes_training, routes_ui
    from kiln.serving.fast_path import FastRoutes
    from kiln.serving.routes_openai import FAST_ROUTES
    from kiln.serving.routes_openai import ROUTERS as OPENAI_ROUTERS
    from kiln.serving.routes_ops import RequestMetricsMiddleware
    from kiln.serving.routes_ops import router as ops_router

    kiln_state = state or build_state(loaded_settings, loaded_model)
    settings = kiln_state.settings
    policy = SecurityPolicy.from_settings(settings.server)
    redact = PathRedactor.from_settings(settings, kiln_state.model.path)
    evals, openenv, judgments = kiln_state.evals, kiln_state.openenv, kiln_state.judgments

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Reclaim staging left by a publication that was killed mid-way.
        await asyncio.to_thread(kiln_state.store.cleanup)
        kiln_state.engine.start()
        await asyncio.to_thread(restore_served, kiln_state)  # what was served before a restart, before requests
        evals.start()
        if kiln_state.trainer is not None:
            kiln_state.trainer.start()
        openenv.start()
        try:
            yield
        finally:
            await asyncio.to_thread(openenv.close)  # first: a run in flight becomes `interrupted`, workers joined
            await asyncio.to_thread(evals.close)  # first: a job waiting on a gate gets its `error` verdict
            if kiln_state.trainer is not None:
                await asyncio.to_thread(kiln_state.trainer.close)
            await asyncio.to_thread(kiln_state.engine.stop)
            judgments.close()

    app = FastAPI(
        title="Kiln",
        summary="OpenAI-compatible serving with LoRA training while serving",
        version=_version(),
        lifespan=lifespan,
    )
    app.state.kiln = kiln_state
    app.state.redact_paths = redact
    install_error_handlers(app, redact.text)
    routers: tuple[APIRouter, ...] = (*OPENAI_ROUTERS, ops_router, routes_training.router, routes_adapters.router, routes_ui.router)
    routers += (routes_evals.router,)
    from kiln.serving import routes_teachers  # noqa: E402  (teachers: registry and probes)
    routers += (routes_teachers.router,)
    from kiln.serving import routes_openenv  # noqa: E402  (OpenEnv runs -> GRPO; docs/openenv.md)
    routers += (routes_openenv.router,)
    from kiln.serving import routes_batch  # noqa: E402  (POST /v1/completions/batch)
    routers += (routes_batch.router,)
    from kiln.serving import routes_judgments  # noqa: E402  (A/B judgments -> judge adapters; docs/evals.md)
    routers += (routes_judgments.router,)
    for router in routers:
        app.include_router(router)
    install_openapi(app, kiln_state.model_id, RuntimeBounds.of(kiln_state))
    # Innermost first: the generation routes skip FastAPI's per-request machinery but stay
    # inside the metrics, body-limit and security middlewares.
    app.add_middleware(FastRoutes, state=kiln_state, routes=FAST_ROUTES)
    from kiln.serving.teacher_wire import TeacherWireMiddleware  # Accept: binary prompt logprobs (Kiln-to-Kiln)
    app.add_middleware(TeacherWireMiddleware)
    app.state.request_log = build_request_log(kiln_state)
    app.add_middleware(RequestMetricsMiddleware, metrics=kiln_state.metrics,
                       routes=[route for router in routers for route in router.routes],
                       request_log=app.state.request_log, model_id=kiln_state.model_id)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.server.max_body_bytes,
        # The upload route streams its body under adapters.max_upload_bytes itself.
        overrides={r"/v1/adapters/[^/]+/upload": None},
    )
    app.add_middleware(SecurityMiddleware, policy=policy)
    return app


def build_request_log(kiln_state: KilnState):
    """The recent-request log when ``server.debug_requests`` > 0 (GET /v1/debug/requests), else None."""
    server = kiln_state.settings.server
    if not server.debug_requests:
        return None
    from kiln.serving.request_log import RequestLog

    tokenizer = kiln_state.model.tokenizer
    return RequestLog(server.debug_requests, keep_text=server.debug_requests_text,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def _version() -> str:
    from kiln import __version__

    return __version__
