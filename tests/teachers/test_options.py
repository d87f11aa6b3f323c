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
    with pytest.raises(OptionError, match="twice"):
        parse_vllm_options(["--seed=1", "--seed=2"])
    with pytest.raises(OptionError, match="twice"):
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
