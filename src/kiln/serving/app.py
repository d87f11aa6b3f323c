"""The FastAPI application: ``create_app(loaded_settings, ...)``.

``request.app.state.kiln`` is a :class:`KilnState` holding the settings (with
provenance), the loaded model, the engine, the metrics and the trainer (``None``
until training attaches). The engine starts in the app's lifespan, then training
attaches (when ``training.enabled``), then the server accepts requests; shutdown
stops the engine, which ends every open row.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from kiln.config import LoadedSettings
from kiln.serving.body_limit import BodyLimitMiddleware
from kiln.serving.errors import install_error_handlers
from kiln.serving.metrics import Metrics


@dataclass
class KilnState:
    loaded_settings: LoadedSettings
    model: Any  # kiln.runtime.loader.LoadedModel
    engine: Any  # kiln.runtime.engine.Engine
    metrics: Metrics
    system_fingerprint: str
    started_at: float = field(default_factory=time.time)
    trainer: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def settings(self):
        return self.loaded_settings.settings

    @property
    def ownership(self):
        return self.engine.ownership

    @property
    def model_id(self) -> str:
        return self.model.model_id


def default_fingerprint(base_model_sha256: str) -> str:
    return f"kiln-{base_model_sha256[:16]}"


def build_state(loaded_settings: LoadedSettings, loaded_model: Any = None) -> KilnState:
    """Load the model (unless given) and build the engine; nothing starts yet."""
    from kiln.runtime.engine import Engine, EngineConfig

    settings = loaded_settings.settings
    if loaded_model is None:
        loaded_model = load_configured_model(settings)
    holder: dict[str, Any] = {}
    metrics = Metrics(lambda: holder["engine"].stats())
    engine = Engine(loaded_model, EngineConfig.from_settings(settings), observer=metrics)
    holder["engine"] = engine
    fingerprint = settings.server.system_fingerprint or default_fingerprint(loaded_model.base_model_sha256)
    return KilnState(loaded_settings, loaded_model, engine, metrics, fingerprint)


def load_configured_model(settings: Any) -> Any:
    """Resolve ``model.path`` (built-in model when unset), device and dtype, and load."""
    from kiln.runtime.builtin import ensure_builtin_model
    from kiln.runtime.loader import load_model

    if settings.model.threads:
        import torch

        torch.set_num_threads(settings.model.threads)
    path = settings.model.path or ensure_builtin_model(settings.home_path)
    return load_model(path, device=settings.model.device, dtype=settings.model.dtype,
                      model_id=settings.model.served_model_id)


def create_app(loaded_settings: LoadedSettings, loaded_model: Any = None, *, state: KilnState | None = None) -> FastAPI:
    """Build the app. Pass ``state`` to reuse a prepared one (``kiln serve`` does), else the model loads here."""
    from kiln.serving import routes_adapters, routes_training
    from kiln.serving.fast_path import FastRoutes
    from kiln.serving.routes_openai import FAST_ROUTES
    from kiln.serving.routes_openai import router as openai_router
    from kiln.serving.routes_ops import RequestMetricsMiddleware
    from kiln.serving.routes_ops import router as ops_router

    kiln_state = state or build_state(loaded_settings, loaded_model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from kiln.adapters.store import AdapterStore

        # Reclaim staging left by a publication that was killed mid-way.
        await asyncio.to_thread(AdapterStore(kiln_state.settings.adapters_path).cleanup)
        kiln_state.engine.start()
        if kiln_state.settings.training.enabled:
            from kiln.training.service import attach_training

            await asyncio.to_thread(attach_training, kiln_state)
        try:
            yield
        finally:
            trainer = kiln_state.trainer
            close = getattr(trainer, "close", None)
            if callable(close):
                await asyncio.to_thread(close)
            await asyncio.to_thread(kiln_state.engine.stop)

    app = FastAPI(
        title="Kiln",
        summary="OpenAI-compatible serving with LoRA training while serving",
        version=_version(),
        lifespan=lifespan,
    )
    app.state.kiln = kiln_state
    install_error_handlers(app)
    routers = (openai_router, ops_router, routes_training.router, routes_adapters.router)
    for router in routers:
        app.include_router(router)
    # Innermost first: the generation routes skip FastAPI's per-request machinery but stay
    # inside the metrics and body-limit middlewares.
    app.add_middleware(FastRoutes, state=kiln_state, routes=FAST_ROUTES)
    app.add_middleware(RequestMetricsMiddleware, metrics=kiln_state.metrics,
                       routes=[route for router in routers for route in router.routes])
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=kiln_state.settings.server.max_body_bytes,
        # The upload route streams its body under adapters.max_upload_bytes itself.
        overrides={r"/v1/adapters/[^/]+/upload": None},
    )
    return app


def _version() -> str:
    from kiln import __version__

    return __version__
