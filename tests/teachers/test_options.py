"""Extra vLLM options and environment: one refusal per class, plus what is accepted."""

from __future__ import annotations

import pytest

from kiln.teachers.options import (
    OptionError,
    bound_environment,
    check_environment,
    determinism_policy,
    launch_environment,
    parse_vllm_options,
)


def test_accepts_transport_inference_and_switches():
    opts = parse_vllm_options(
        ["--host=127.0.0.1", "--port=8000", "--api-key=s3cret", "--seed=0", "--enforce-eager",
         "--dtype=float32", "--language-model-only", "--attention-backend=TRITON_ATTN", "--max_num_seqs=8"]
    )
    assert opts.inference == (
        "--attention-backend=TRITON_ATTN", "--dtype=float32", "--enforce-eager", "--language-model-only",
        "--max-num-seqs=8", "--seed=0",
    )
    assert opts.transport == ("--host=127.0.0.1", "--port=8000", "--api-key=s3cret")
    assert "s3cret" not in " ".join(opts.redacted_transport())
    assert determinism_policy({}, opts)["seed"] == "0" and determinism_policy({}, opts)["enforce_eager"] is True


@pytest.mark.parametrize(
    "token,match",
    [
        ("--load-format=pt", "safetensors"),
        ("--attention-backend=FLASH_ATTN", "TRITON_ATTN"),
        ("--attention-backend=my.module.Backend", "TRITON_ATTN"),
        ("--trust-remote-code", "Hub"),
        ("--revision=main", "Hub"),
        ("--enable-lora", "runtime-LoRA"),
        ("--lora-modules=x=/a", "runtime-LoRA"),
        ("--max-loras=2", "runtime-LoRA"),
        ("--lora-resolver-cache-dir=/x", "runtime-LoRA"),
        ("--enable-prompt-adapter", "runtime-LoRA"),
        ("--worker-extension-plugin=x", "runtime-LoRA"),
        ("--served-model-name=x", "owned by the launcher"),
        ("--max-logprobs=100", "owned by the launcher"),
        ("--fingerprint-value=x", "owned by the launcher"),
        ("--middleware=x", "owned by the launcher"),
        ("--model=/m", "owned by the launcher"),
        ("--chat-template=/t.jinja", "template"),
        ("--config=/c.yaml", "file, path"),
        ("--tokenizer-path=/t", "file, path"),
        ("--compilation-config-file=/x", "file, path"),
        ("--speculative-model=foo", "not a reviewed"),
        ("--no-such-option=1", "not a reviewed"),
        ("--dtype", "needs a value"),
        ("--enforce-eager=true", "valueless"),
        ("--seed=-1", "integer"),
        ("--gpu-memory-utilization=1.5", r"\(0, 1\]"),
        ("model-path", "single '--key=value'"),
        ("-x", "single '--key=value'"),
        ("--Dtype=float32", "lowercase"),
    ],
)
def test_refused_options(token, match):
    with pytest.raises(OptionError, match=match):
        parse_vllm_options([token])


def test_refuses_two_token_form_duplicates_and_too_many():
    with pytest.raises(OptionError, match="same token"):
        parse_vllm_options(["--dtype", "float32"])
    with pytest.raises(OptionError, match="more than once"):
        parse_vllm_options(["--seed=1", "--seed=2"])
    with pytest.raises(OptionError, match="more than once"):
        parse_vllm_options(["--max-num-seqs=1", "--max_num_seqs=2"])
    with pytest.raises(OptionError, match="at most"):
        parse_vllm_options(["--enforce-eager"] * 65)


def test_api_key_value_never_in_errors():
    with pytest.raises(OptionError) as exc:
        parse_vllm_options(["--api-key="])
    assert "redacted" in str(exc.value)


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("PYTHONPATH", "/x", "shadow"),
        ("PYTHONHOME", "/x", "shadow"),
        ("PYTHONUSERBASE", "/x", "shadow"),
        ("PYTHONSAFEPATH", "1", "shadow"),
        ("LD_PRELOAD", "/x.so", "shadow"),
        ("LD_LIBRARY_PATH", "/x", "shadow"),
        ("VLLM_CACHE_ROOT", "/x", "fresh private cache"),
        ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1", "runtime LoRA"),
        ("VLLM_PLUGINS", "x", "plugin"),
        ("VLLM_LORA_RESOLVER_CACHE_DIR", "/x", "plugin"),
        ("VLLM_LOGGING_CONFIG_PATH", "/x.json", "file, path"),
        ("HIPBLASLT_TUNING_OVERRIDE_FILE", "/x", "file, path"),
        ("HF_HOME", "/x", "home"),
        ("CUDA_HOME", "/x", "home"),
        ("TRITON_CACHE_DIR", "/x", "cache"),
        ("TORCHINDUCTOR_CACHE_DIR", "/x", "cache"),
        ("ROCM_PATH", "/x", "path"),
        ("VLLM_SKIP_MODEL_NAME_VALIDATION", "1", "model-name validation"),
    ],
)
def test_refused_environment(name, value, match):
    with pytest.raises(OptionError, match=match):
        check_environment({"PATH": "/usr/bin", name: value})


def test_accepted_environment_is_bound_without_secrets_or_cache_path():
    env = {
        "PATH": "/usr/bin", "VLLM_CPU_KVCACHE_SPACE": "1", "ROCR_VISIBLE_DEVICES": "0", "VLLM_API_KEY": "k",
        "HF_TOKEN": "t", "OMP_NUM_THREADS": "2", "PYTHONHASHSEED": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0",
    }
    check_environment(env)
    launch = launch_environment(env, "/caches/cache-1-00")
    bound = bound_environment(launch)
    assert launch["VLLM_CACHE_ROOT"] == "/caches/cache-1-00"
    assert "VLLM_CACHE_ROOT" not in bound and "VLLM_API_KEY" not in bound and "HF_TOKEN" not in bound
    assert bound["ROCR_VISIBLE_DEVICES"] == "0" and bound["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert bound["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "0" and bound["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "PATH" not in bound


# ------------------------------------------------- allowlist first, by value kind


def test_reviewed_option_is_never_refused_for_a_word_in_its_name():
    opts = parse_vllm_options(["--kv-cache-dtype=fp8", "--enable-prefix-caching"])
    assert opts.inference == ("--enable-prefix-caching", "--kv-cache-dtype=fp8")
    with pytest.raises(OptionError, match="must be one of"):  # its value is still checked
        parse_vllm_options(["--kv-cache-dtype=/tmp/cache"])
    with pytest.raises(OptionError, match="file, path"):  # an unreviewed cache option stays refused
        parse_vllm_options(["--kv-cache-dir=/tmp/cache"])


def test_reviewed_options_are_disjoint_from_every_refused_class():
    from kiln.teachers import options as o

    reviewed = set(o.TRANSPORT_OPTIONS) | set(o.INFERENCE_OPTIONS) | o.TRANSPORT_SWITCHES | o.INFERENCE_SWITCHES
    assert not reviewed & (o.LAUNCHER_OWNED | o.HUB_OPTIONS | {"load-format"})
    for name in reviewed:
        assert not set(name.split("-")) & o._RUNTIME_ADAPTER_TOKENS, name
    # every reviewed variable lies in a vetted namespace (else the table would never be consulted)
    assert all(name.startswith(o.BOUND_ENV_PREFIXES) for name in o.REVIEWED_ENV)


# Real variable names from vLLM's envs.py and the torch, CUDA, ROCm, NCCL, Triton and
# Hugging Face documentation; each names a file, folder, path, directory, module,
# plugin, library, executable, home, root or cache.
PATH_NAMING_ENV = [
    # vLLM
    "VLLM_TUNED_CONFIG_FOLDER", "VLLM_CONFIG_ROOT", "VLLM_RPC_BASE_PATH", "VLLM_NCCL_SO_PATH",
    "VLLM_CUDART_SO_PATH", "VLLM_MODEL_REDIRECT_PATH", "VLLM_LOGGING_CONFIG_PATH", "VLLM_XLA_CACHE_PATH",
    "VLLM_ASSETS_CACHE", "VLLM_TORCH_PROFILER_DIR", "VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_PLUGINS",
    "VLLM_DEBUG_DUMP_PATH", "VLLM_PRECOMPILED_WHEEL_LOCATION",
    # torch / inductor / dynamo
    "PYTORCH_TUNABLEOP_FILENAME", "PYTORCH_TUNABLEOP_UNTUNED_FILENAME", "PYTORCH_TUNABLEOP_VERBOSE_FILENAME",
    "PYTORCH_KERNEL_CACHE_PATH", "TORCH_HOME", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_CUTLASS_DIR", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCH_COMPILE_DEBUG_DIR",
    "TORCH_LOGS_OUT", "TORCH_TRACE", "TORCHINDUCTOR_PROFILE_OUTPUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_FR_DUMP_TEMP_FILE",
    # CUDA / cuBLAS / cuDNN
    "CUDA_HOME", "CUDA_PATH", "CUDA_CACHE_PATH", "CUDA_INJECTION64_PATH", "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY", "CUBLASLT_LOG_FILE", "CUBLAS_LOGDEST_DBG", "CUDNN_LOGDEST_DBG",
    # ROCm / HIP / MIOpen / rocBLAS / hipBLASLt
    "ROCM_PATH", "ROCM_HOME", "HIP_PATH", "HIP_CLANG_PATH", "HSA_TOOLS_LIB", "MIOPEN_USER_DB_PATH",
    "MIOPEN_CUSTOM_CACHE_DIR", "MIOPEN_SYSTEM_DB_PATH", "ROCBLAS_TENSILE_LIBPATH", "ROCBLAS_LOG_TRACE_PATH",
    "HIPBLASLT_TUNING_FILE", "HIPBLASLT_TUNING_OVERRIDE_FILE", "HIPBLASLT_LOG_FILE",
    # NCCL / RCCL
    "NCCL_DEBUG_FILE", "NCCL_TOPO_FILE", "NCCL_TOPO_DUMP_FILE", "NCCL_GRAPH_FILE", "NCCL_NET_PLUGIN",
    "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN",
    # Triton
    "TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TRITON_CACHE_MANAGER",
    "TRITON_REMOTE_CACHE_BACKEND", "TRITON_PTXAS_PATH", "TRITON_LIBCUDA_PATH", "TRITON_LIBDEVICE_PATH",
    "TRITON_CUOBJDUMP_PATH", "TRITON_NVDISASM_PATH", "TRITON_HIP_LLD_PATH",
    # Hugging Face
    "HF_HOME", "HF_HUB_CACHE", "HF_ASSETS_CACHE", "HF_DATASETS_CACHE", "HF_MODULES_CACHE", "HF_TOKEN_PATH",
    "HF_XET_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE",
    # native libraries
    "OMP_TOOL_LIBRARIES", "LD_DEBUG_OUTPUT", "LD_RUN_PATH",
]


@pytest.mark.parametrize("name", PATH_NAMING_ENV)
def test_path_naming_environment_refused(name):
    # The value is a harmless word: the name alone decides.
    with pytest.raises(OptionError, match="names a file, path, folder, directory, module"):
        check_environment({"PATH": "/usr/bin", name: "x"})


# Reviewed scalars whose names contain CACHE or MODULE: what their value is decides.
REVIEWED_SCALAR_ENV = [
    ("CUDA_MODULE_LOADING", "LAZY"), ("CUDA_MODULE_DATA_LOADING", "EAGER"), ("VLLM_KV_CACHE_LAYOUT", "HND"),
    ("TORCHINDUCTOR_FX_GRAPH_CACHE", "1"), ("TORCHINDUCTOR_AUTOGRAD_CACHE", "0"), ("CUDA_CACHE_DISABLE", "1"),
    ("CUDA_CACHE_MAXSIZE", "4294967296"), ("VLLM_DISABLE_COMPILE_CACHE", "true"), ("VLLM_MM_INPUT_CACHE_GIB", "4"),
    ("VLLM_XGRAMMAR_CACHE_MB", "64"), ("VLLM_V1_USE_OUTLINES_CACHE", "0"), ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1"),
    ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ATTENTION_BACKEND", "TRITON_ATTN"),
    ("VLLM_LOGGING_STREAM", "ext://sys.stderr"),
]


# Other scalar variables of the bound namespaces (no path word in the name, no path value).
OTHER_SCALAR_ENV = [
    ("CUDA_VISIBLE_DEVICES", "0,1"), ("ROCR_VISIBLE_DEVICES", "0"), ("PYTORCH_TUNABLEOP_ENABLED", "1"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"), ("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    ("NCCL_SOCKET_IFNAME", "eth0"), ("TORCH_CUDA_ARCH_LIST", "8.0;9.0"), ("VLLM_CONFIGURE_LOGGING", "0"),
    ("HSA_OVERRIDE_GFX_VERSION", "11.0.0"), ("TRITON_KERNEL_DUMP", "0"),
]


@pytest.mark.parametrize("name,value", REVIEWED_SCALAR_ENV + OTHER_SCALAR_ENV)
def test_scalar_environment_accepted_and_bound(name, value):
    env = {"PATH": "/usr/bin", name: value}
    check_environment(env)
    assert bound_environment(launch_environment(env, None))[name] == value


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("CUDA_MODULE_LOADING", "/opt/mod", "must be one of"),
        ("TORCHINDUCTOR_FX_GRAPH_CACHE", "/tmp/graphs", "must be 0, 1"),
        ("VLLM_KV_CACHE_LAYOUT", "bogus", "must be one of"),
        ("VLLM_LOGGING_STREAM", "ext://evil.module.stream", "must be one of"),
        # vLLM may import a class named here: the same closed set as --attention-backend.
        ("VLLM_ATTENTION_BACKEND", "some.module.Class", "TRITON_ATTN"),
        ("VLLM_ATTENTION_BACKEND", "FLASH_ATTN", "TRITON_ATTN"),
        ("VLLM_ATTENTION_BACKEND", "", "TRITON_ATTN"),
        # an unreviewed variable whose value is a filesystem location
        ("VLLM_SOME_FUTURE_KNOB", "/etc/passwd", "filesystem path"),
        ("TORCH_SOMETHING", "~/x", "filesystem path"),
        ("HF_SOMETHING", "file:///x", "filesystem path"),
        ("PYTHONPYCACHEPREFIX", "/tmp/pyc", "shadow"),
    ],
)
def test_environment_value_refusals(name, value, match):
    with pytest.raises(OptionError, match=match) as exc:
        check_environment({"PATH": "/usr/bin", name: value})
    assert name in str(exc.value)
