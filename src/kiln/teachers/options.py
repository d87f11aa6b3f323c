"""Vetting of the extra vLLM options (after ``--``) and of the launch environment.

Options: every token is ``--key=value`` or one of the vetted valueless switches.
Transport options (host, port, API key, TLS, CORS, HTTP logging) are passed
through but never enter the identity. Reviewed scalar inference options are
passed through and bound. Everything the launcher owns (model, tokenizer, format,
generation config, logprobs, fingerprint, middleware, LoRA/adapters) and every
file, path, directory or template input is refused; anything else is unknown and
refused too (fail closed). Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

OPTIONS_POLICY = "kiln.vllm-options.v1"
MAX_EXTRA_OPTIONS = 64
MAX_OPTION_TOKEN_CHARS = 4096
API_KEY_OPTION = "api-key"
REDACTED = "<redacted>"
REVIEWED_ATTENTION_BACKENDS = ("TRITON_ATTN",)


class OptionError(ValueError):
    """An extra vLLM option or an environment variable is refused; the message says why."""


def _choice(*values: str) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v not in values:
            raise ValueError(f"must be one of {', '.join(values)}")
        return v

    return check


def _int(lo: int, hi: int) -> Callable[[str], str]:
    def check(v: str) -> str:
        if not re.fullmatch(r"[0-9]+", v) or not lo <= int(v) <= hi:
            raise ValueError(f"must be an integer in {lo}..={hi}")
        return str(int(v))

    return check


def _fraction(v: str) -> str:
    try:
        f = float(v)
    except ValueError:
        raise ValueError("must be a number in (0, 1]") from None
    if not (0.0 < f <= 1.0) or not re.fullmatch(r"[0-9]*\.?[0-9]+", v):
        raise ValueError("must be a number in (0, 1]")
    return v


def _attention_backend(v: str) -> str:
    # vLLM may import a class named here, so the value set is closed.
    if v not in REVIEWED_ATTENTION_BACKENDS:
        raise ValueError(
            f"is not reviewed; accepted: {', '.join(REVIEWED_ATTENTION_BACKENDS)} (omit the option for vLLM's "
            "automatic choice)"
        )
    return v


def _text(v: str) -> str:
    if not v or not v.isprintable():
        raise ValueError("must be a non-empty printable value")
    return v


TRANSPORT_OPTIONS: dict[str, Callable[[str], str]] = {
    "host": _text,
    "port": _int(1, 65535),
    API_KEY_OPTION: _text,
    "ssl-keyfile": _text,
    "ssl-certfile": _text,
    "ssl-ca-certs": _text,
    "allowed-origins": _text,
    "allowed-methods": _text,
    "allowed-headers": _text,
    "uvicorn-log-level": _choice("critical", "error", "warning", "info", "debug", "trace"),
}
TRANSPORT_SWITCHES = frozenset({"allow-credentials", "disable-uvicorn-access-log", "disable-log-stats", "enable-log-requests"})

# Reviewed scalar inference options; their accepted values are identity-bound.
INFERENCE_OPTIONS: dict[str, Callable[[str], str]] = {
    "dtype": _choice("auto", "half", "float16", "bfloat16", "float", "float32"),
    "seed": _int(0, 2**32 - 1),
    "gpu-memory-utilization": _fraction,
    "max-num-seqs": _int(1, 1 << 16),
    "max-num-batched-tokens": _int(1, 1 << 24),
    "block-size": _choice("1", "8", "16", "32", "64", "128"),
    "tensor-parallel-size": _int(1, 1024),
    "pipeline-parallel-size": _int(1, 1024),
    "scheduling-policy": _choice("fcfs", "priority"),
    "kv-cache-dtype": _choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "distributed-executor-backend": _choice("mp", "uni"),
    "attention-backend": _attention_backend,
}
INFERENCE_SWITCHES = frozenset(
    {
        "enforce-eager",
        "language-model-only",
        "enable-prefix-caching",
        "no-enable-prefix-caching",
        "enable-chunked-prefill",
        "no-enable-chunked-prefill",
    }
)

LAUNCHER_OWNED = frozenset(
    {
        "model", "served-model-name", "max-model-len", "max-logprobs", "logprobs-mode", "generation-config",
        "fingerprint-mode", "fingerprint-value", "middleware", "tokenizer", "tokenizer-mode", "skip-tokenizer-init",
        "hf-overrides", "override-generation-config", "quantization", "task", "runner", "convert",
        "max-lora-rank", "max-loras", "max-cpu-loras", "lora-dtype", "enable-lora", "lora-modules",
    }
)
HUB_OPTIONS = frozenset({"trust-remote-code", "revision", "code-revision", "tokenizer-revision", "hf-token", "download-dir"})
_RUNTIME_ADAPTER_TOKENS = frozenset({"lora", "loras", "resolver", "resolvers", "plugin", "plugins", "adapter", "adapters"})
_PATH_TOKENS = frozenset({"file", "files", "path", "paths", "dir", "directory", "template", "config", "root", "cache", "download", "json"})
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(frozen=True)
class VllmOptions:
    inference: tuple[str, ...]  # normalized "--key=value" / "--switch", sorted; identity-bound
    transport: tuple[str, ...]  # in the caller's order; never identity-bound

    def redacted_transport(self) -> list[str]:
        return [f"--{API_KEY_OPTION}={REDACTED}" if t.startswith(f"--{API_KEY_OPTION}=") else t for t in self.transport]

    def value(self, name: str) -> str | None:
        for tok in self.inference:
            key, _, val = tok[2:].partition("=")
            if key == name:
                return val if "=" in tok else ""
        return None


def _classify_refusal(name: str) -> str | None:
    """Why an option outside the reviewed allowlist is refused (None: merely unknown)."""
    tokens = set(name.split("-"))
    if name == "load-format":
        return "--load-format is owned by the launcher: base weights always load as safetensors"
    if name in HUB_OPTIONS:
        return f"--{name} names a Hub input; the launcher serves only the staged local snapshot (no Hub IDs, revisions or remote code)"
    if tokens & _RUNTIME_ADAPTER_TOKENS or "prompt-adapter" in name:
        return f"--{name} is a runtime-LoRA, adapter, resolver or plugin setting; use --adapter-path for one static adapter"
    if name in LAUNCHER_OWNED:
        return f"--{name} is owned by the launcher (model, tokenizer, limits, logprobs, fingerprint and LoRA are set from the identity)"
    if tokens & _PATH_TOKENS:
        return f"--{name} takes a file, path, directory or template, whose content the identity could not bind"
    return None


def parse_vllm_options(tokens: list[str]) -> VllmOptions:
    """Vet the tokens after ``--``; raise :class:`OptionError` naming the first refused one."""
    if len(tokens) > MAX_EXTRA_OPTIONS:
        raise OptionError(f"{len(tokens)} extra vLLM options; at most {MAX_EXTRA_OPTIONS} are accepted")
    inference: list[str] = []
    transport: list[str] = []
    seen: set[str] = set()
    for tok in tokens:
        if len(tok) > MAX_OPTION_TOKEN_CHARS:
            raise OptionError(f"an extra option is longer than {MAX_OPTION_TOKEN_CHARS} characters")
        if not tok.startswith("--") or tok == "--":
            raise OptionError(f"{tok!r}: extra vLLM options must be single '--key=value' tokens (no positional or short forms)")
        key, has_value, value = tok[2:].partition("=")
        if not _NAME_RE.fullmatch(key):
            raise OptionError(f"{tok!r}: option names are lowercase letters, digits, '-' and '_'")
        name = key.replace("_", "-")
        # --x and --no-x set one option: both, or either twice, is ambiguous.
        option = name[3:] if name.startswith("no-") else name
        if option in seen:
            raise OptionError(
                f"--{name}: --{option} is given more than once (or with its --no- form); each option is one "
                "unambiguous token"
            )
        seen.add(option)
        # The reviewed allowlist decides first: a reviewed option is never refused for a
        # word in its name (--kv-cache-dtype takes a dtype, not a cache path).
        if name in TRANSPORT_SWITCHES or name in INFERENCE_SWITCHES:
            if has_value:
                raise OptionError(f"--{name} is a valueless switch; write it without '='")
            (transport if name in TRANSPORT_SWITCHES else inference).append(f"--{name}")
            continue
        validator = TRANSPORT_OPTIONS.get(name) or INFERENCE_OPTIONS.get(name)
        if validator is None:
            raise OptionError(
                _classify_refusal(name) or f"--{name} is not a reviewed vLLM option; unknown options are refused"
            )
        if not has_value:
            raise OptionError(f"--{name} needs a value in the same token: --{name}=VALUE")
        try:
            checked = validator(value)
        except ValueError as exc:
            shown = REDACTED if name == API_KEY_OPTION else value
            raise OptionError(f"--{name}={shown}: {exc}") from None
        (transport if name in TRANSPORT_OPTIONS else inference).append(f"--{name}={checked}")
    return VllmOptions(inference=tuple(sorted(inference)), transport=tuple(transport))


# ----------------------------------------------------------------- environment

REJECTED_ENV = frozenset(
    {
        "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "PYTHONPLATLIBDIR",
        "PYTHONSTARTUP", "PYTHONEXECUTABLE", "PYTHONPYCACHEPREFIX", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT",
    }
)
# Namespaces whose values may change inference; their accepted values are identity-bound.
BOUND_ENV_PREFIXES = (
    "VLLM_", "CUDA_", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NVIDIA_", "NCCL_", "RCCL_", "ROCM_", "ROCR_", "HIP_",
    "HIPBLASLT_", "HIPBLAS_", "ROCBLAS_", "HSA_", "AMD_", "MIOPEN_", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_",
    "PYTORCH_", "TRITON_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "KMP_", "GOMP_", "MKL_",
    "OPENBLAS_", "ONEDNN_", "DNNL_", "PYTHON", "LD_", "GLIBC_", "MALLOC_",
)


def _flag(v: str) -> str:
    if v.lower() not in ("0", "1", "true", "false"):
        raise ValueError("must be 0, 1, true or false")
    return v


# Reviewed variables of those namespaces, classified by what their value is (a flag,
# a bounded integer, a closed choice). This table decides before the name rule below,
# so a scalar whose name merely contains CACHE or MODULE is accepted and bound.
REVIEWED_ENV: dict[str, Callable[[str], str]] = {
    "CUDA_MODULE_LOADING": _choice("LAZY", "EAGER"),
    "CUDA_MODULE_DATA_LOADING": _choice("LAZY", "EAGER"),
    "CUDA_CACHE_DISABLE": _flag,
    "CUDA_CACHE_MAXSIZE": _int(0, 1 << 32),
    "VLLM_KV_CACHE_LAYOUT": _choice("NHD", "HND"),
    "VLLM_CPU_KVCACHE_SPACE": _int(0, 1 << 20),
    "VLLM_MM_INPUT_CACHE_GIB": _int(0, 1 << 20),
    "VLLM_XGRAMMAR_CACHE_MB": _int(0, 1 << 20),
    "VLLM_DISABLE_COMPILE_CACHE": _flag,
    "VLLM_V1_USE_OUTLINES_CACHE": _flag,
    "TORCHINDUCTOR_FX_GRAPH_CACHE": _flag,
    "TORCHINDUCTOR_AUTOGRAD_CACHE": _flag,
    "TORCHINDUCTOR_FORCE_DISABLE_CACHES": _flag,
    # vLLM may import a class named here, exactly as for --attention-backend.
    "VLLM_ATTENTION_BACKEND": _attention_backend,
    # logging.config resolves ext:// names by importing them; only the two streams are reviewed.
    "VLLM_LOGGING_STREAM": _choice("ext://sys.stdout", "ext://sys.stderr"),
}
# Name tokens (split on "_") of a variable that names a file, folder, path, directory,
# module, plugin, library, executable, home, root or cache (fused forms included).
PATH_ENV_TOKENS = frozenset(
    {"FILE", "FILES", "FILENAME", "FILENAMES", "FILEPATH", "PATH", "PATHS", "LIBPATH", "SOPATH", "DIR", "DIRS",
     "DIRNAME", "DIRECTORY", "FOLDER", "FOLDERS", "CACHEDIR", "LOGDIR", "TMPDIR", "LOGDEST", "LOCATION", "PLUGIN",
     "PLUGINS", "EXECUTABLE", "EXE", "BIN", "HOME", "ROOT", "CACHE", "CACHES", "PREFIX", "LIB", "LIBS", "LIBRARY",
     "LIBRARIES", "MODULE", "MODULES", "CLASS", "RESOLVER", "RESOLVERS"}
)
# Path-valued variables whose names carry none of those tokens.
PATH_NAMED_ENV = frozenset(
    {"TORCH_LOGS_OUT", "TORCH_TRACE", "TORCHINDUCTOR_PROFILE_OUTPUT", "LD_DEBUG_OUTPUT", "CUDNN_LOGDEST_DBG",
     "CUBLAS_LOGDEST_DBG", "HIPBLASLT_TUNING_OVERRIDE_FILE"}
)
SECRET_ENV_TOKENS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD"})
TRANSPORT_ENV = frozenset({"VLLM_HOST_IP", "VLLM_PORT"})
CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Switches that open vLLM's mutable or control surfaces, so weights or engine state
# could change under an unchanged fingerprint (the spec: "disables mutable model
# surfaces"). VLLM_SERVER_DEV_MODE mounts /collective_rpc, /sleep, /wake_up, the
# cache-reset and weight-update routes; VLLM_ALLOW_INSECURE_SERIALIZATION lets the
# engine's message channel unpickle arbitrary objects; the profiler switches mount
# /start_profile and /stop_profile (VLLM_TORCH_PROFILER_DIR, which does too, is refused
# as a path). Each is refused unless unset or exactly "0".
MUTATING_ENV = {
    "VLLM_SERVER_DEV_MODE": "mounts /collective_rpc, /sleep, /wake_up and the weight-update routes",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "lets the engine unpickle arbitrary objects (code execution, weight changes)",
    "VLLM_TORCH_CUDA_PROFILE": "mounts the /start_profile and /stop_profile control routes",
}
# Name tokens of a vLLM switch this table does not know yet but that names a
# development, insecure or profiling mode: refused too (fail closed).
MUTATING_ENV_TOKENS = frozenset({"DEV", "INSECURE", "PROFILE", "PROFILER", "PROFILING"})
FORCED_ENV = {
    RUNTIME_LORA_ENV: "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
DETERMINISM_ENV = (
    "PYTHONHASHSEED",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "CUBLAS_WORKSPACE_CONFIG",
    "TORCH_CUDNN_V8_API_DISABLED",
    "CUDNN_DETERMINISTIC",
)


def _is_path_value(value: str) -> bool:
    """A value that is itself a filesystem location (absolute, home-relative, dot-relative or file: URL)."""
    v = value.strip()
    return v.startswith(("/", "~", "./", "../")) or v in (".", "..") or v.lower().startswith("file:")


def check_environment(env: Mapping[str, str]) -> None:
    """Refuse shadow-code, path-naming, runtime-LoRA, mutable-surface, resolver and plugin variables."""
    for name in sorted(env):
        upper = name.upper()
        tokens = set(upper.split("_"))
        if upper in REJECTED_ENV:
            raise OptionError(f"{name} is set; unset it (it can shadow the runtime's code or libraries)")
        if upper == CACHE_ROOT_ENV:
            raise OptionError(f"{name} is set; unset it: every launch gets a fresh private cache under --cache-root")
        if upper == RUNTIME_LORA_ENV:
            if env[name].strip().lower() not in ("", "0", "false"):
                raise OptionError(f"{name}={env[name]} enables runtime LoRA updates; unset it (the launcher forces 0)")
            continue
        if not upper.startswith(BOUND_ENV_PREFIXES) or upper.startswith("PYTHON"):
            continue
        validator = REVIEWED_ENV.get(upper)
        if validator is not None:
            try:
                validator(env[name])
            except ValueError as exc:
                raise OptionError(f"{name}={env[name]!r}: {exc}; set a reviewed value or unset {name}") from None
            continue
        if "SKIP" in tokens and "VALIDATION" in tokens:
            raise OptionError(f"{name} skips model-name validation; unset it")
        if tokens & PATH_ENV_TOKENS or upper in PATH_NAMED_ENV:
            raise OptionError(
                f"{name} names a file, path, folder, directory, module, plugin, library, executable, home, root or "
                "cache; unset it (its content could not be bound into the identity)"
            )
        if upper in MUTATING_ENV or (upper.startswith("VLLM_") and tokens & MUTATING_ENV_TOKENS):
            if env[name] != "0":
                why = MUTATING_ENV.get(upper, "names a development, insecure or profiling mode of vLLM")
                raise OptionError(
                    f"{name} is set: it {why}, a mutable surface the teacher identity cannot cover; unset it"
                )
        if _is_path_value(env[name]):
            raise OptionError(
                f"{name} is set to a filesystem path; unset it (a path string cannot bind the content it names)"
            )


def launch_environment(env: Mapping[str, str], cache_dir: str | None) -> dict[str, str]:
    """The environment vLLM (and the runtime recheck) receive: ambient plus forced values."""
    out = dict(env)
    out.update(FORCED_ENV)
    if cache_dir is not None:
        out[CACHE_ROOT_ENV] = cache_dir
    return out


def bound_environment(env: Mapping[str, str]) -> dict[str, str]:
    """Inference-affecting variables of a launch environment (no secrets, transport or cache path)."""
    out = {}
    for name, value in env.items():
        upper = name.upper()
        if not upper.startswith(BOUND_ENV_PREFIXES) or upper in (CACHE_ROOT_ENV, *TRANSPORT_ENV):
            continue
        if set(upper.split("_")) & SECRET_ENV_TOKENS:
            continue
        out[name] = value
    return dict(sorted(out.items()))


def determinism_policy(env: Mapping[str, str], options: VllmOptions) -> dict[str, object]:
    policy: dict[str, object] = {name: env.get(name) for name in DETERMINISM_ENV}
    policy["seed"] = options.value("seed")
    policy["enforce_eager"] = options.value("enforce-eager") is not None
    return policy
