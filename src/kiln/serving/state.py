"""The composition root: :func:`build_state` builds every long-lived object once and wires them.

``kiln serve`` (and any embedding) calls :func:`build_state` once. It loads the
model (device and dtype resolved there), builds the engine on it (the built-in
:class:`~kiln.runtime.engine.Engine` or the vLLM facade, one
:class:`~kiln.runtime.serving_engine.ServingEngine` seam), ONE
:class:`~kiln.adapters.store.AdapterStore` over ``adapters_path``, the teacher service,
the eval service, the :class:`~kiln.training.queue.service.TrainingService` (when
``training.enabled``; it gets the teachers and the evals for its OPD jobs and post-train
gates) and the OpenEnv run service, each with its dependencies handed to it explicitly.
Nothing starts here (OpenEnv's restart recovery reads its run records); the app's lifespan
starts the engine, the evals, training, then OpenEnv.

Routes reach these objects through :func:`get_state`, which is typed, so an IDE
follows a chat request (route -> ``state.engine``) and a training job (route ->
``state.trainer`` -> its engine and store) without guessing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pathlib import Path

from kiln.config import LoadedSettings, Settings
from kiln.serving.metrics import Metrics

if TYPE_CHECKING:  # heavy modules (torch) load only when the state is built
    from fastapi import Request

    from kiln.adapters.activation import AdapterActivation
    from kiln.adapters.served import ServedSet
    from kiln.adapters.store import AdapterStore
    from kiln.evals.service import EvalService
    from kiln.judgments.service import JudgmentService
    from kiln.openenv.service import OpenEnvService
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel
    from kiln.runtime.memory_budget import MemoryBudget
    from kiln.runtime.ownership import AcceleratorOwnership
    from kiln.runtime.serving_engine import ServingEngine
    from kiln.runtime.vllm_engine import VllmEngine
    from kiln.teachers.service import TeacherService
    from kiln.training.queue.service import TrainingService


@dataclass
class KilnState:
    """Everything a request handler may use, built by :func:`build_state`."""

    loaded_settings: LoadedSettings
    model: LoadedModel
    engine: ServingEngine  # serving.engine: builtin (Engine) | vllm (VllmEngine), one seam
    store: AdapterStore
    trainer: TrainingService | None  # None when training.enabled is false
    metrics: Metrics
    system_fingerprint: str
    evals: EvalService  # suites, runs and post-train gates
    openenv: OpenEnvService  # OpenEnv runs -> GRPO
    judgments: JudgmentService  # A/B preferences -> judge adapters (docs/evals.md, "Judgments")
    activation: AdapterActivation  # the one way an adapter revision comes onto the engine (kiln.adapters.activation)
    started_at: float = field(default_factory=time.time)
    teachers: TeacherService | None = None  # this server's teacher identity and the teacher registry
    served: ServedSet | None = None  # the served adapter set kept across restarts (restore_served)
    adapters_not_restored: list[dict[str, str]] = field(default_factory=list)  # /health
    memory: MemoryBudget | None = None  # memory admission for training jobs and adapter loads (/health)
    # Per-process caches of route modules (e.g. the token-text decoder); never services.
    extras: dict[str, object] = field(default_factory=dict)

    @property
    def settings(self) -> Settings:
        return self.loaded_settings.settings

    @property
    def ownership(self) -> AcceleratorOwnership:
        return self.engine.ownership

    @property
    def model_id(self) -> str:
        return self.model.model_id


def require_experimental(state: KilnState, what: str) -> None:
    """Refuse ``what`` (403 ``stable_profile``) on a server whose ``serving.profile`` is ``stable``."""
    if state.settings.serving.profile == "stable":
        from kiln.errors import Forbidden

        raise Forbidden(f"{what} is refused by this server's serving profile (serving.profile = stable)",
                        code="stable_profile", hint="run training and experimental features on a server started "
                                                    "with serving.profile = experimental (the default)")


def get_state(request: Request) -> KilnState:
    """The app's :class:`KilnState` (``request.app.state.kiln``), typed."""
    state: KilnState = request.app.state.kiln
    return state


def default_fingerprint(base_model_sha256: str) -> str:
    return f"kiln-{base_model_sha256[:16]}"


def build_state(loaded_settings: LoadedSettings, loaded_model: LoadedModel | None = None) -> KilnState:
    """Load the model (unless given), build the engine, the adapter store and the training service."""
    from kiln.adapters.store import AdapterStore
    from kiln.runtime.engine import Engine, EngineConfig

    settings = loaded_settings.settings
    from kiln.runtime.reasoning import check_reasoning_parser_setting
    from kiln.serving.tool_parsers import check_tool_parser_setting

    check_tool_parser_setting(settings.serving.tool_call_parser)  # a bad name fails before the model loads
    check_reasoning_parser_setting(settings.serving.reasoning_parser)
    secure_state_dirs(settings)
    model = loaded_model if loaded_model is not None else load_configured_model(settings)
    quantize_configured(settings, model)
    engine_box: list[Engine] = []
    metrics = Metrics(lambda: engine_box[0].stats())
    fingerprint = settings.server.system_fingerprint or default_fingerprint(model.base_model_sha256)
    engine_config = EngineConfig.from_settings(settings, model.max_model_len)
    if settings.serving.engine == "vllm":  # a supervised vLLM subprocess behind the same facade (docs/scale.md)
        engine = build_vllm_engine(settings, model, engine_config, metrics, fingerprint)
    else:
        engine = Engine(model, engine_config, observer=metrics)
    engine_box.append(engine)
    store = AdapterStore(settings.adapters_path)
    memory = build_memory_budget(settings, model, engine)
    from kiln.teachers.service import build_teachers

    teachers = build_teachers(settings, model, engine, store)
    from kiln.adapters.activation import AdapterActivation
    from kiln.adapters.served import ServedSet

    served = ServedSet(store.root, public=store.has)  # not an eval's private load
    activation = AdapterActivation(engine, store, model.base_model_sha256, memory=memory, served=served,
                                   on_canary_failed=metrics.canary_failed)
    evals = build_evals(settings, model, engine, store, metrics)
    evals.memory = memory  # eval submissions are admitted by memory
    evals.activation = activation  # private loads of eval targets and judges: quarantine, memory, canary
    trainer = build_training(settings, engine, store, model) if settings.training.enabled else None
    if trainer is not None:
        trainer.set_teachers(teachers)  # OPD jobs resolve their teacher here
        trainer.set_eval_service(evals)  # post_eval gates
        trainer.memory = memory  # memory admission at submission and at the job's start
        trainer.activation = activation  # auto_load / activate_on_pass: the same checks as an operator load
        trainer.observer = metrics  # step time, tokens/s
        metrics.bind_pacer(trainer.pacer.snapshot)
        metrics.bind_counts("training", trainer.jobs.counts)
    openenv = build_openenv(settings, engine, trainer, metrics)
    judgments = build_judgments(settings, engine, trainer)
    state = KilnState(loaded_settings, model, engine, store, trainer, metrics, fingerprint, evals, openenv, judgments,
                      activation, teachers=teachers, served=served, memory=memory)
    if trainer is not None:  # post_eval.set_default_on_pass: a promoted revision becomes the server default
        from kiln.serving.default_adapter import set_default

        trainer.set_default = lambda name, revision: set_default(state, name, revision)
    return state


def build_memory_budget(settings: Settings, model: LoadedModel, engine: ServingEngine) -> MemoryBudget:
    """The process's memory budget (limits.memory_budget_bytes caps the detected memory); resident:
    the weights (counted once) and the engine's KV pool and linear-state slots, read live."""
    from kiln.runtime.memory import memory_total_bytes
    from kiln.runtime.memory_budget import MemoryBudget
    from kiln.runtime.quantize import weight_bytes

    weights = weight_bytes(model.model)  # an int8 head copy included (kiln.runtime.quantize.quantize_head)

    def resident() -> dict[str, int]:
        stats = engine.stats()
        return {"weights": weights, "kv_cache": int(stats.get("kv_cache_bytes", 0)),
                "linear_state": int(stats.get("linear_state_bytes", 0))}

    return MemoryBudget(memory_total_bytes(model.device), settings.limits.memory_budget_bytes, resident)


def restore_served(state: KilnState) -> None:
    """At start-up, before requests: serve again what was served before the restart (each at its
    revision, through the activation service), then record every later change of the served set
    (blocking: run it off the loop)."""
    if state.served is None:
        return
    served = state.served
    state.adapters_not_restored, saved_default = state.activation.restore()
    state.engine.on_adapters_changed = state.activation.record_served
    configured = state.settings.adapters.default
    if configured:  # the operator's start-up default wins over the saved one; failing it stops start-up
        from kiln.errors import KilnError
        from kiln.serving.default_adapter import parse_setting, set_default

        try:
            set_default(state, *parse_setting(configured))
        except KilnError as exc:
            raise RuntimeError(f"adapters.default = {configured!r} cannot be served: {exc.message}") from exc
    elif saved_default is not None and state.engine.active_adapters().get(saved_default[0]) == saved_default[1]:
        served.default = saved_default  # restored with its pinned revision
    elif saved_default is not None:
        name, revision = saved_default
        state.adapters_not_restored.append({"name": name, "revision": revision,
                                            "error": "the default adapter's revision is not served; default cleared"})
    served.save(state.engine.active_adapters())


def build_vllm_engine(settings: Settings, model: LoadedModel, engine_config, metrics: Metrics, fingerprint: str):
    """``serving.engine = "vllm"``: the facade over a vLLM child serving this model's snapshot; the model
    loaded here stays for tokenization and training (the trainer's copy). ConfigError names a bad [vllm] key."""
    from kiln.runtime.vllm_engine import VllmEngine
    from kiln.runtime.vllm_process import plan_from_settings

    plan = plan_from_settings(settings, model_dir=model.path, served_model_id=model.model_id,
                              max_model_len=engine_config.max_model_len, loaded_dtype=model.dtype,
                              fingerprint=fingerprint)
    return VllmEngine(model, engine_config, plan, observer=metrics)


def build_training(settings: Settings, engine: Engine, store: AdapterStore, model: LoadedModel) -> TrainingService:
    """The training service over the serving engine's model and the one adapter store (not started)."""
    from kiln.training.queue.service import TrainingService

    return TrainingService(engine=engine, store=store, settings=settings, model=model)


def build_evals(settings: Settings, model: LoadedModel, engine: ServingEngine, store: AdapterStore,
                metrics: Metrics) -> EvalService:
    """The eval service over the served engine and the one adapter store (not started); its metrics
    join the server's registry."""
    from kiln.evals.service import EvalService

    evals = EvalService(engine=engine, store=store, settings=settings, model=model, registry=metrics.registry)
    metrics.bind_counts("eval", evals.runs.counts)
    return evals


def build_judgments(settings: Settings, engine: ServingEngine, trainer: TrainingService | None) -> JudgmentService:
    """The judgment store (opened here) over the served engine (judge scoring) and the trainer (judge jobs)."""
    from kiln.judgments.service import JudgmentService

    return JudgmentService(engine=engine, trainer=trainer, settings=settings)


def build_openenv(settings: Settings, engine: ServingEngine, trainer: TrainingService | None,
                  metrics: Metrics) -> OpenEnvService:
    """The OpenEnv run service over the engine and the trainer (not started; restart recovery of its
    runs happens here, before any request)."""
    from kiln.openenv.service import OpenEnvService

    return OpenEnvService(engine=engine, trainer=trainer, settings=settings, registry=metrics.registry)


def load_configured_model(settings: Settings) -> LoadedModel:
    """Resolve ``model.path`` (built-in model when unset), device and dtype, and load."""
    from kiln.runtime.builtin import ensure_builtin_model
    from kiln.runtime.loader import load_model, resolve_device

    import torch

    from kiln.runtime.threads import default_threads

    torch.set_num_threads(settings.model.threads or default_threads())
    path = settings.model.path or ensure_builtin_model(settings.home_path)
    from kiln.runtime.linear_kernels import choose

    choose(settings.model.linear_kernels)  # a hybrid's Gated DeltaNet kernels (kiln.runtime.linear_kernels)
    mode = settings.model.quantize
    if mode != "none" and resolve_device(settings.model.device) == "cpu":  # never the whole float model
        from kiln.runtime.quantize_load import load_quantized

        return load_quantized(path, mode, dtype=settings.model.dtype, model_id=settings.model.served_model_id,
                              max_kl=settings.model.quantize_max_kl)
    return load_model(path, device=settings.model.device, dtype=settings.model.dtype,
                      model_id=settings.model.served_model_id)


def quantize_configured(settings: Settings, model: LoadedModel) -> None:
    """``model.quantize``: the base's linear layers quantized in place (once), the probe KL checked
    against ``model.quantize_max_kl`` (kiln.runtime.quantize; QuantizationRefused above it)."""
    mode = settings.model.quantize
    if model.quantization is not None or mode == "none":  # load_quantized quantized it while loading
        return
    from kiln.runtime.quantize import quantize_loaded

    quantize_loaded(model, mode, settings.model.quantize_max_kl)


def base_representation(model: LoadedModel) -> str:
    """The served base's representation: the quantized mode, else the load dtype."""
    report = model.quantization
    return report.effective if report is not None else str(model.dtype)


PRIVATE_DIR_MODE = 0o700
PRIVATE_UMASK = 0o077  # kiln serve: files it creates are 0600, directories 0700


def secure_state_dirs(settings: Settings) -> list[Path]:
    """Create Kiln's state directories as 0700 and tighten existing ones this user owns.

    Covers ``$KILN_HOME``, its ``training`` directory, the adapter store and the
    training data directory. A directory owned by someone else is left alone.
    """
    home = settings.home_path
    dirs = [home, home / "training", settings.adapters_path, settings.data_path]
    for d in dirs:
        d.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        st = d.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o777 != PRIVATE_DIR_MODE:
            d.chmod(PRIVATE_DIR_MODE)
    return dirs
