"""Kiln settings with per-field provenance.

Precedence, lowest to highest::

    defaults  <  kiln.toml  <  KILN_<SECTION>_<FIELD> environment  <  CLI flags

The TOML file is the first of ``--config``, ``$KILN_CONFIG`` and ``./kiln.toml``
that is given/exists. Unknown sections or keys and invalid values fail at start-up
with a :class:`ConfigError` that names the key. Every effective value remembers
where it came from; ``GET /v1/config`` reports both.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "KILN_"
DEFAULT_PORT = 8420


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key and its source."""


# [vllm] extra_args: every vLLM option but these is the operator's (kiln.runtime.vllm_process passes them on).
# Options Kiln owns: what vLLM loads, where it listens, who may call it, which adapters and logprobs it serves.
MANAGED_OPTIONS = frozenset({
    "model", "served-model-name", "host", "port", "api-key", "uds", "ssl-keyfile", "ssl-certfile",
    "tensor-parallel-size", "pipeline-parallel-size", "distributed-executor-backend", "dtype",
    "max-model-len", "max-logprobs", "logprobs-mode", "load-format", "tokenizer", "revision",
    "tokenizer-revision", "trust-remote-code", "enable-lora", "max-loras", "max-lora-rank", "lora-modules",
    "max-cpu-loras", "fingerprint-mode", "fingerprint-value", "generation-config", "allowed-local-media-path",
    "middleware", "root-path", "download-dir", "hf-token", "chat-template",
})


def check_extra_args(args: Iterable[str]) -> tuple[str, ...]:
    """Each extra vLLM option is one ``--key=value`` token (or a bare ``--switch``) Kiln does not own."""
    out = []
    for arg in args:
        if not re.fullmatch(r"--[a-z0-9][a-z0-9-]*(=.*)?", arg, flags=re.DOTALL):
            raise ValueError(f"{arg!r} is not one --key=value token (write e.g. '--enforce-eager' or "
                             "'--gpu-memory-utilization=0.8')")
        key = arg[2:].split("=", 1)[0]
        if key in MANAGED_OPTIONS or key.startswith("no-enable-lora"):
            raise ValueError(f"--{key} is set by Kiln (model, transport, parallelism, LoRA, logprobs and identity "
                             "are Kiln's); use the matching [vllm] or [model] key instead")
        out.append(arg)
    return tuple(out)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSettings(_Section):
    host: str = "127.0.0.1"  # address to bind (loopback by default; see docs/serving.md before binding elsewhere)
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)  # TCP port
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=1024**3)  # request body limit (413 above it)
    request_timeout_s: float = Field(600.0, gt=0, le=86400)  # a generation request's deadline (503 request_timeout)
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # server log verbosity
    system_fingerprint: str | None = Field(None, min_length=1, max_length=512)  # default: kiln-<model sha256[:16]>
    # Browser and network exposure (kiln.serving.security). Lists also read "a,b" from the environment.
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted besides localhost and the bound address
    allowed_origins: tuple[str, ...] = ()  # origins allowed to make state-changing requests; CORS for these only
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")  # NAME of the env var holding the key
    expose_paths: bool = False  # show absolute server paths in responses (off: they are replaced by $KILN_HOME/...)
    # Slow-client bounds (seconds): request head, request body, idle keep-alive, graceful shutdown.
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    body_timeout_s: float = Field(60.0, gt=0, le=86400)  # request body read deadline (408)
    keep_alive_timeout_s: int = Field(5, ge=1, le=3600)  # idle keep-alive connection lifetime
    graceful_shutdown_s: int = Field(5, ge=0, le=3600)  # time running requests get on SIGTERM
    # Diagnostics (docs/latency.md): GET /v1/debug/requests keeps this many recent requests in memory (0: off, 404)
    debug_requests: int = Field(0, ge=0, le=100_000)
    debug_requests_text: bool = False  # the recent-request log also keeps prompt and completion text
    debug_model_state: bool = False  # GET /v1/debug/model-state (off: 404); for a trusted diagnostic boundary

    @field_validator("allowed_hosts", "allowed_origins", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value


class ModelSettings(_Section):
    path: str | None = None  # None: the built-in model under $KILN_HOME
    served_model_id: str | None = None  # default: the model directory's name
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on CUDA that supports it, float32 on CPU
    threads: int = Field(0, ge=0, le=1024)  # 0: every core but one (kiln.runtime.threads)
    prefill_threads: int = Field(0, ge=0, le=1024)  # prompt-only engine cycles; 0: every core when threads = 0
    # weight-only quantization of the decoder's linear layers at load (embedding and LM head stay float, the head
    # gets an int8 inference copy; on the CPU loaded tensor by tensor, never the whole float model; Kiln's C kernel
    # or torch's packed matmuls, chosen by measurement; not with serving.engine = vllm; docs/serving.md "Quantization")
    quantize: Literal["none", "int8", "int4"] = "none"
    # refuse to start when the probe set's mean per-token KL(float || quantized) in nats exceeds this
    quantize_max_kl: float | None = Field(None, ge=0)
    # a Qwen3.5 hybrid's Gated DeltaNet functions in transformers' forward: auto: flash-linear-attention's and
    # causal-conv1d's kernels for CUDA tensors where installed (the hybrid-cuda extra), else the torch reference;
    # reference: the torch reference everywhere (GET /health linear_state.kernels; docs/serving.md "Model families")
    linear_kernels: Literal["auto", "reference"] = "auto"


class BatchingSettings(_Section):
    token_budget: int = Field(512, ge=1, le=1_000_000)  # tokens (prompt chunks + decoding rows) per scheduling cycle
    max_running_rows: int = Field(32, ge=1, le=4096)  # rows decoding at once
    max_queued_rows: int = Field(256, ge=1, le=1_000_000)  # rows waiting for a slot (429 beyond); 0 would serve nothing
    prefill_chunk_tokens: int = Field(256, ge=1, le=1_000_000)  # a long prompt is prefilled in chunks of this many tokens
    kv_budget_bytes: int = Field(0, ge=0)  # paged KV pool size; 0: max_running_rows x max_model_len worth
    kv_budget_fraction: float = Field(0.0, ge=0.0, le=0.9)  # or this fraction of RAM (CUDA: device memory)
    kv_block_size: int = Field(16, ge=1, le=4096)  # tokens per KV block
    prefix_cache: bool = True  # share identical prompt-prefix blocks (same adapter revision)
    compile_decode: bool = False  # torch.compile the decode step (bucketed static shapes); docs/benchmarks.md
    burst_gap_s: float = Field(0.001, ge=0.0, le=0.1)  # waking idle: gather requests this far apart (docs/serving.md)
    mixed_step_factor: float = Field(1.5, ge=0.0, le=100.0)  # prompt tokens beside decoding rows (docs/serving.md)
    lean_forward: bool = True  # Llama-family and Qwen3.5-hybrid forwards without transformers' per-call Python
    packed_weights: bool = True  # oneDNN-packed Linear weights in that forward (CPU, fp32; 2x their memory)
    paged_attention: bool = True  # that forward's decode attention reads KV blocks in place (CPU, fp32; C kernel)


class LimitsSettings(_Section):
    max_model_len: int = Field(2048, ge=8, le=1_048_576)  # prompt + output tokens (capped by the model's own limit)
    default_max_tokens: int = Field(256, ge=1, le=1_048_576)  # max_tokens when a request omits it
    max_tokens_cap: int = Field(2048, ge=1, le=1_048_576)  # largest max_tokens accepted
    max_n: int = Field(16, ge=1, le=256)  # largest n (choices per request)
    max_messages: int = Field(512, ge=1, le=100_000)  # messages per chat request (checked before parsing them)
    max_stop_sequences: int = Field(8, ge=0, le=64)  # stop strings per request
    max_logprobs: int = Field(20, ge=0, le=1000)  # top logprobs per generated token
    max_prompt_logprobs: int = Field(20, ge=0, le=1000)  # top logprobs per prompt token (scoring; 0 disables the teacher fingerprint)
    grammar_compile_timeout_s: float = Field(2.0, gt=0.0, le=60.0)  # structured output: compile deadline
    grammar_cache_mib: int = Field(64, ge=0, le=65_536)  # compiled grammars kept (estimated resident MiB)
    max_batch_prompts: int = Field(64, ge=1, le=256)  # prompts in one POST /v1/completions/batch
    # memory this process plans for (weights, KV pool, training jobs, adapters); 0: the detected memory
    # (device or RAM within a cgroup limit). A cap, never more than detected (docs/serving.md, "Memory admission")
    memory_budget_bytes: int = Field(0, ge=0)


class TrainingSettings(_Section):
    enabled: bool = True  # accept training jobs (serving.profile = stable turns this off)
    queue_max: int = Field(16, ge=1, le=10_000)  # queued + running jobs (429 beyond)
    data_dir: str | None = None  # default: $KILN_HOME/data
    max_examples: int = Field(10_000, ge=1, le=10_000_000)  # examples one job may read
    compile: bool = False  # torch.compile each SFT job's trunk (docs/training.md: pays only on long jobs)
    # while chats wait, the share of time serving gets between two exclusive training holds (docs/latency.md)
    serving_share: float = Field(0.5, ge=0.0, lt=1.0, allow_inf_nan=False)
    # while chats wait, the longest one training hold should take: steps are sliced into micro-batches to fit (0: whole steps)
    max_hold_ms: float = Field(50.0, ge=0.0, le=60_000.0, allow_inf_nan=False)
    # while chats wait, each hold's budget is this many of serving's recent cycles (at least 2 ms, at most max_hold_ms; 0: max_hold_ms alone)
    hold_cycles: float = Field(0.0, ge=0.0, le=1_000.0, allow_inf_nan=False)
    # while chats wait, also cut a row's forward and backward between decoder layers, so one long row is several holds (docs/latency.md)
    layer_holds: bool = True
    warm_up: bool = True  # build the default anchor, the locality probes and a first LoRA adapter at start, before the first job needs them (docs/training.md, "Locality"; GET /v1/train/status warm_up)


class AdapterSettings(_Section):
    dir: str | None = None  # default: $KILN_HOME/adapters
    max_upload_bytes: int = Field(512 * 1024 * 1024, ge=1024, le=64 * 1024**3)  # largest adapter archive accepted by POST /v1/adapters/{name}/upload
    # the server default adapter at start-up, NAME or NAME@REVISION (docs/adapters.md); empty: keep the saved one
    default: str = Field("", max_length=200, pattern=r"^([A-Za-z0-9._-]+(@[0-9a-f]{64})?)?$")


class LocalitySettings(_Section):
    """``[locality]``: what every training job measures of its adapter's locality, and the guard that holds
    back activation under its thresholds (docs/training.md, "Locality"; docs/adapters.md, "Locality guard")."""

    measure: bool = True  # measure every job's locality (a job's request can turn it off: locality.measure)
    probes: int = Field(16, ge=0, le=256)  # questions the base model writes for the probe set (repeats dropped)
    max_tokens: int = Field(24, ge=1, le=256)  # tokens per probe answer
    seed: int = Field(0, ge=0, le=2**31 - 1)  # seeds the probe questions (cached per base model and settings)
    guard: bool = True  # auto_load, post_eval activate_on_pass / set_default_on_pass hold back an adapter under the thresholds
    min_unchanged: float = Field(0.8, ge=0.0, le=1.0, allow_inf_nan=False)  # least share of probe answers unchanged
    max_degenerate: int = Field(0, ge=0, le=256)  # most probe answers the adapter makes degenerate
    max_kl: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)  # most mean KL(base || adapter) per token, nats; 0: no bound


class EvalSettings(_Section):
    eval_dir: str | None = None  # suites, datasets and the runs database; default: $KILN_HOME/evals
    allow_code_execution: bool = False  # the `code` scorer runs model output in a sandbox (docs/evals.md)


class OpenEnvSettings(_Section):
    """``[openenv]``: bounds on server-owned OpenEnv runs (docs/openenv.md)."""

    max_active_runs: int = Field(1, ge=1, le=64)  # runs collecting/training at once (strict FIFO admission)
    max_tracked_runs: int = Field(16, ge=1, le=10_000)  # queued + active runs; more are refused 429
    max_discovery_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=64 * 1024**2)  # per discovery document
    max_frame_bytes: int = Field(1024 * 1024, ge=1024, le=256 * 1024**2)  # per WebSocket frame received
    max_rollout_bytes: int = Field(512 * 1024 * 1024, ge=4096, le=16 * 1024**3)  # everything one run retains
    exchange_timeout_s: float = Field(30.0, gt=0, le=3600)  # one WebSocket exchange (and each discovery GET)
    capacity_wait_s: float = Field(60.0, ge=0, le=3600)  # CAPACITY_REACHED backoff deadline per episode
    generation_timeout_s: float = Field(120.0, gt=0, le=3600)  # one policy action


class ServingSettings(_Section):
    """``[serving]``: which engine runs the model (docs/scale.md, "Serving with vLLM")."""

    engine: Literal["builtin", "vllm"] = "builtin"  # vllm: a supervised vLLM subprocess ([vllm])
    # stable: serving only (training, OpenEnv training runs and adapter merges refused, training off);
    # experimental: everything (docs/serving.md, "Serving profiles")
    profile: Literal["experimental", "stable"] = "experimental"
    # how tool calls are read from the model's text (as vLLM's --tool-call-parser): "auto" picks by the
    # chat template's family; a name picks that parser (kiln.serving.tool_parsers; checked at start-up)
    tool_call_parser: str = Field("auto", min_length=1, max_length=64)
    # how reasoning is told apart from the answer (as vLLM's --reasoning-parser): "auto" picks by the chat
    # template's family, "none" turns it off, a name picks that parser (kiln.runtime.reasoning; checked at start-up)
    reasoning_parser: str = Field("auto", min_length=1, max_length=64)
    # reasoning tokens a chat answer may spend before the span is closed for it (requests' thinking_token_budget
    # when they omit it); None: unlimited. Only with a reasoning parser.
    thinking_token_budget: int | None = Field(None, ge=0, le=1_048_576)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


class VllmSettings(_Section):
    """``[vllm]``: the vLLM engine subprocess (``serving.engine = "vllm"``; docs/scale.md).

    KILN_VLLM_<FIELD> sets a field; other KILN_VLLM_* variables (the test lane's KILN_VLLM,
    the teacher launcher's KILN_VLLM_SNAPSHOT_ROOT, ...) are not settings and are ignored here."""

    python: str | None = None  # the vLLM environment's interpreter; default <source root>/.vllm-venv/bin/python
    tensor_parallel_size: int = Field(1, ge=1, le=1024)  # vLLM --tensor-parallel-size
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)  # vLLM --pipeline-parallel-size
    ray_address: str | None = Field(None, min_length=1, max_length=512)  # set: --distributed-executor-backend=ray
    hosts: tuple[str, ...] = ()  # the hosts the world must span (rank law's selected hosts); default: this host
    max_loras: int = Field(4, ge=0, le=256)  # LoRAs in one batch; 0: vLLM without LoRA (faster, no adapters)
    max_lora_rank: int = 16  # vLLM --max-lora-rank (one of the ranks vLLM accepts)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: the dtype Kiln loaded the model in
    kv_cache_gib: int = Field(1, ge=1, le=4096)  # VLLM_CPU_KVCACHE_SPACE (CPU backend) unless already set
    port: int = Field(0, ge=0, le=65535)  # loopback port of the child; 0: a free one
    startup_timeout_s: float = Field(600.0, gt=0, le=86400)  # how long the vLLM child may take to become healthy
    state_dir: str | None = None  # private parent of snapshots, caches and logs; default $KILN_HOME/vllm-engine
    extra_args: tuple[str, ...] = ()  # more vLLM options, each one "--key=value" token Kiln does not own

    # lists also read "a,b" from the environment, as [server]'s do
    _split_list = field_validator("hosts", "extra_args", mode="before")(ServerSettings._split_list.__func__)  # type: ignore[attr-defined]

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(f"must be one of {VLLM_LORA_RANKS} (vLLM's supported LoRA rank caps)")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_extra_args(value)


_CANONICAL_HTTPS_ORIGIN = r"^https://[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[1-9][0-9]{0,4})?$"


class TeacherCredential(_Section):
    """``[teachers.credentials.<id>]``: the exact HTTPS origin a teacher answers on and the NAME of the
    environment variable that holds its bearer key (the key itself never enters Kiln's settings)."""

    origin: str = Field(pattern=_CANONICAL_HTTPS_ORIGIN)
    api_key_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @field_validator("origin")
    @classmethod
    def _no_default_port(cls, value: str) -> str:
        if value.endswith(":443"):
            raise ValueError("write the canonical origin without the default port :443")
        return value


class TeachersSettings(_Section):
    registry_path: str | None = None  # default: $KILN_HOME/teachers/registry.json
    credentials: dict[str, TeacherCredential] = {}  # [teachers.credentials.<id>] origin, api_key_env
    request_timeout_s: float = Field(120.0, gt=0, le=3600)  # one request to a remote teacher

    @field_validator("credentials")
    @classmethod
    def _ids(cls, value: dict[str, TeacherCredential]) -> dict[str, TeacherCredential]:
        from kiln.system.credentials import CREDENTIAL_ID_PATTERN

        for cid in value:
            if not re.fullmatch(CREDENTIAL_ID_PATTERN, cid):
                raise ValueError(f"credential id {cid!r}: 1-64 letters, digits, '.', '_', '-'")
        return value


class Settings(_Section):
    home: str | None = None
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    batching: BatchingSettings = BatchingSettings()
    limits: LimitsSettings = LimitsSettings()
    training: TrainingSettings = TrainingSettings()
    adapters: AdapterSettings = AdapterSettings()
    locality: LocalitySettings = LocalitySettings()
    eval: EvalSettings = EvalSettings()
    teachers: TeachersSettings = TeachersSettings()
    openenv: OpenEnvSettings = OpenEnvSettings()
    serving: ServingSettings = ServingSettings()
    vllm: VllmSettings = VllmSettings()

    @model_validator(mode="after")
    def _cross_field(self) -> "Settings":
        if self.limits.default_max_tokens > self.limits.max_tokens_cap:
            raise ValueError("limits.default_max_tokens must not exceed limits.max_tokens_cap")
        if self.limits.max_tokens_cap > self.limits.max_model_len:
            raise ValueError("limits.max_tokens_cap must not exceed limits.max_model_len")
        if self.batching.kv_budget_bytes and self.batching.kv_budget_fraction:
            raise ValueError("set batching.kv_budget_bytes or batching.kv_budget_fraction, not both")
        if 0.0 < self.batching.mixed_step_factor < 1.0:
            raise ValueError("batching.mixed_step_factor is a factor >= 1 (or 0 for no limit)")
        return self

    # -- derived paths -------------------------------------------------------
    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser() if self.home else kiln_home()

    @property
    def adapters_path(self) -> Path:
        return Path(self.adapters.dir).expanduser() if self.adapters.dir else self.home_path / "adapters"

    @property
    def data_path(self) -> Path:
        return Path(self.training.data_dir).expanduser() if self.training.data_dir else self.home_path / "data"

    @property
    def teachers_registry_path(self) -> Path:
        return (Path(self.teachers.registry_path).expanduser() if self.teachers.registry_path
                else self.home_path / "teachers" / "registry.json")

    @property
    def eval_path(self) -> Path:
        return Path(self.eval.eval_dir).expanduser() if self.eval.eval_dir else self.home_path / "evals"


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Settings.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, _Section)
}
TOP_LEVEL = {"home"}


def kiln_home() -> Path:
    """``$KILN_HOME`` or ``~/.cache/kiln``."""
    env = os.environ.get("KILN_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kiln"


class LoadedSettings:
    """Effective settings plus the source of every field."""

    def __init__(self, settings: Settings, sources: dict[str, str], config_file: Path | None):
        self.settings = settings
        self.sources = sources
        self.config_file = config_file

    def effective(self) -> dict[str, dict[str, Any]]:
        """``{"section.field": {"value": ..., "source": ...}}`` for every field."""
        out: dict[str, dict[str, Any]] = {}
        dumped = self.settings.model_dump(mode="json")
        for key in TOP_LEVEL:
            out[key] = {"value": dumped[key], "source": self.sources.get(key, "default")}
        for section in SECTIONS:
            for name, value in dumped[section].items():
                dotted = f"{section}.{name}"
                out[dotted] = {"value": value, "source": self.sources.get(dotted, "default")}
        return dict(sorted(out.items()))


def check_quantize_engine(settings: "Settings", sources: dict[str, str] | None = None) -> None:
    """``model.quantize`` with ``serving.engine = "vllm"``: ConfigError before anything loads (vLLM loads
    its own float weights; the quantized copy would only cost a load)."""
    if settings.model.quantize != "none" and settings.serving.engine == "vllm":
        where = sources or {}
        raise ConfigError(
            f"model.quantize = {settings.model.quantize} (from {where.get('model.quantize', 'default')}) applies to "
            f"the built-in engine only, but serving.engine = vllm (from {where.get('serving.engine', 'default')}); "
            "vLLM loads its own weights: use vLLM's quantized checkpoints through [vllm].extra_args")


def _check_key(section: str, key: str | None, origin: str) -> None:
    if section in TOP_LEVEL and key is None:
        return
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r} ({origin}); known: {sorted(SECTIONS) + sorted(TOP_LEVEL)}")
    if key is not None and key not in SECTIONS[section].model_fields:
        raise ConfigError(
            f"unknown config key {section}.{key} ({origin}); known keys in [{section}]: "
            f"{sorted(SECTIONS[section].model_fields)}"
        )


def _layer_from_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    origin = f"file {path}"
    for section, body in data.items():
        if section in TOP_LEVEL:
            continue
        _check_key(section, None, origin)
        if not isinstance(body, dict):
            raise ConfigError(f"[{section}] in {path} must be a table")
        for key in body:
            _check_key(section, key, origin)
    return data


def _layer_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        if rest == "home":
            layer["home"] = value
            continue
        section, _, key = rest.partition("_")
        if section not in SECTIONS:
            continue  # KILN_CONFIG, KILN_VENV, test switches: not settings
        if section == "vllm" and key not in VllmSettings.model_fields:
            continue  # KILN_VLLM (test lane), KILN_VLLM_SNAPSHOT_ROOT (teacher launcher), ...: not settings
        if not key:
            raise ConfigError(f"environment variable {name} names no field of [{section}]")
        _check_key(section, key, f"environment variable {name}")
        layer.setdefault(section, {})[key] = value
    return layer


def _merge(base: dict[str, Any], layer: dict[str, Any], sources: dict[str, str], label: str) -> None:
    for section, body in layer.items():
        if section in TOP_LEVEL:
            base[section] = body
            sources[section] = label
            continue
        for key, value in body.items():
            base.setdefault(section, {})[key] = value
            sources[f"{section}.{key}"] = label


def load_settings(
    cli: Mapping[str, Any] | None = None,
    config_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> LoadedSettings:
    """Resolve the effective settings.

    ``cli`` maps dotted keys (``"server.port"``) to values; ``None`` values are
    treated as "not given".
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}

    path: Path | None = None
    if config_path is not None:
        path = Path(config_path)
    elif environ.get("KILN_CONFIG"):
        path = Path(environ["KILN_CONFIG"])
    elif Path("kiln.toml").is_file():
        path = Path("kiln.toml")
    if path is not None:
        _merge(merged, _layer_from_toml(path), sources, "file")

    _merge(merged, _layer_from_env(environ), sources, "env")

    cli_layer: dict[str, Any] = {}
    for dotted, value in (cli or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        _check_key(section, key or None, f"command-line flag for {dotted}")
        if key:
            cli_layer.setdefault(section, {})[key] = value
        else:
            cli_layer[section] = value
    _merge(merged, cli_layer, sources, "cli")

    try:
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            dotted = ".".join(str(p) for p in err["loc"]) or "(settings)"
            src = sources.get(dotted, "default")
            problems.append(f"{dotted} (from {src}): {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
    if settings.serving.profile == "stable" and settings.training.enabled:
        if "training.enabled" in sources:
            raise ConfigError(f"serving.profile = stable refuses training, but training.enabled = true (from "
                              f"{sources['training.enabled']}); drop one of them")
        settings = settings.model_copy(update={"training": settings.training.model_copy(update={"enabled": False})})
        sources["training.enabled"] = "serving.profile"
    check_quantize_engine(settings, sources)
    if settings.teachers.credentials:  # the secrets' variables must be usable now (read again per request)
        from kiln.system.credentials import validate_credentials

        try:
            validate_credentials(settings.teachers.credentials, environ)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return LoadedSettings(settings, sources, path)
