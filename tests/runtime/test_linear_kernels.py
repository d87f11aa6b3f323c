"""A hybrid's Gated DeltaNet functions (kiln.runtime.linear_kernels) on the CPU: the report without
the packages, and the guard when transformers resolved a package's kernel at import. The packages are
built the way transformers sees them: modules named ``fla`` and ``causal_conv1d`` whose functions its
own ``use_kernel_func_from_hub_with_fallback`` resolves in place of the torch reference. Every test puts
transformers' modeling module back as it found it (monkeypatch)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import types

import pytest
import torch

from kiln.runtime import linear_kernels
from kiln.runtime.loader import load_model
from tests.hybrid_models import build_tiny_hybrid

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
# what transformers' modeling module calls -> (the package, where transformers imports it from, its name there)
PACKAGED = {
    "torch_chunk_gated_delta_rule": ("fla", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "torch_recurrent_gated_delta_rule": ("fla", "fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d", "causal_conv1d_fn"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d", "causal_conv1d_update"),
}


@pytest.fixture(scope="module")
def hybrid(builtin_model_dir, tmp_path_factory):
    return load_model(build_tiny_hybrid(tmp_path_factory.mktemp("hybrid"), builtin_model_dir), device="cpu")


@pytest.fixture(autouse=True)
def process_choice(monkeypatch):
    monkeypatch.setitem(linear_kernels._process, "packages", True)  # the process-wide setting, restored after


def modeling():
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq

    return mq


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def greedy(model) -> list[int]:
    with torch.no_grad():
        return model.generate(IDS, max_new_tokens=5, do_sample=False)[0, IDS.shape[1]:].tolist()


def install_packages(monkeypatch, kernel) -> list[str]:
    """Fake ``fla`` and ``causal_conv1d`` modules, and transformers' modeling module holding what its
    decorator resolves from them; ``kernel(reference, name)`` builds each package function. -> calls."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    mq, calls = modeling(), []
    for mod_name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "causal_conv1d"):
        if mod_name not in sys.modules:
            monkeypatch.setitem(sys.modules, mod_name, types.ModuleType(mod_name))
    for attr, (package, where, name) in PACKAGED.items():
        reference = inspect.unwrap(getattr(mq, attr))  # the torch function under whatever wraps it now
        fake = kernel(reference, name, calls)
        fake.__module__ = f"{where}.kernels"
        monkeypatch.setattr(sys.modules[where], name, fake, raising=False)
        monkeypatch.setattr(mq, attr, use_kernel_func_from_hub_with_fallback(name, package)(reference))
    return calls


def gpu_only(reference, name, calls):
    @functools.wraps(reference)
    def kernel(*args, **kwargs):
        calls.append(name)
        raise RuntimeError("0 active drivers ([]). There should only be one.")  # Triton on a CPU-only box

    return kernel


def recording(reference, name, calls):
    @functools.wraps(reference)
    def kernel(*args, **kwargs):
        calls.append(name)
        return reference(*args, **kwargs)

    return kernel


needs_no_packages = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is not None for p in ("fla", "causal_conv1d")),
    reason="flash-linear-attention or causal-conv1d is installed here")


@needs_no_packages
def test_cpu_without_the_packages_reports_the_reference_and_the_lean_forward(hybrid, builtin_model_dir):
    report = hybrid.linear_kernels.describe()
    assert report["requested"] == "auto" and report["effective"] == "reference"
    assert set(report["functions"].values()) == {"torch"}
    assert set(report["functions"]) == {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                                        "causal_conv1d_fn", "causal_conv1d_update", "rms_norm_gated"}
    assert report["reason"].startswith("cpu: the package kernels run on CUDA only")
    lean = hybrid.linear_kernels.describe(lean=True)
    assert lean["effective"] == "lean-c" and "gated_deltanet.c" in lean["reason"]
    assert load_model(builtin_model_dir, device="cpu").linear_kernels is None  # no Gated DeltaNet layer


def test_on_cpu_the_guard_restores_the_reference_transformers_swapped_out(hybrid, monkeypatch):
    want_logits, want_tokens = logits(hybrid.model), greedy(hybrid.model)
    calls = install_packages(monkeypatch, gpu_only)
    assert linear_kernels._parts(getattr(modeling(), "torch_chunk_gated_delta_rule"))[1].__module__.startswith("fla")
    with pytest.raises(RuntimeError, match="active drivers"):  # the trap: transformers' forward calls the kernel
        logits(hybrid.model)
    assert calls
    calls.clear()
    report = linear_kernels.resolve(hybrid.model, "cpu")
    assert report is not None and report.effective == "reference"
    assert "causal_conv1d, fla installed, bypassed here" in report.reason
    torch.testing.assert_close(logits(hybrid.model), want_logits, rtol=0, atol=0)
    assert greedy(hybrid.model) == want_tokens  # the prompt's chunked rule and the decode steps' recurrent one
    assert calls == []
    assert linear_kernels.resolve(hybrid.model, "cpu") == report  # idempotent: one dispatcher per function


def test_tensors_on_a_kernel_device_go_to_the_package_unless_the_setting_says_reference(hybrid, monkeypatch):
    """The CUDA route, exercised with the CPU standing in for CUDA (KERNEL_DEVICES)."""
    want_tokens = greedy(hybrid.model)
    calls = install_packages(monkeypatch, recording)
    monkeypatch.setattr(linear_kernels, "KERNEL_DEVICES", frozenset({"cpu"}))
    report = linear_kernels.resolve(hybrid.model, "cpu", "auto")
    assert report is not None and report.effective == "causal-conv1d+fla"
    assert report.functions["chunk_gated_delta_rule"] == "fla" and report.functions["rms_norm_gated"] == "torch"
    assert report.reason == "the package kernels on CUDA"
    assert greedy(hybrid.model) == want_tokens
    assert set(calls) == {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                          "causal_conv1d_update"}
    calls.clear()
    report = linear_kernels.resolve(hybrid.model, "cpu", "reference")
    assert report is not None and report.describe()["effective"] == "reference"
    assert report.requested == "reference" and report.reason == "model.linear_kernels = reference"
    assert greedy(hybrid.model) == want_tokens and calls == []


@needs_no_packages
def test_a_missing_package_is_named_on_a_kernel_device(hybrid, monkeypatch):
    monkeypatch.setattr(linear_kernels, "KERNEL_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(linear_kernels.importlib.util, "find_spec", lambda name: None)
    report = linear_kernels.resolve(hybrid.model, "cpu")
    assert report is not None and report.effective == "reference"
    assert report.reason == ("flash-linear-attention not installed; causal-conv1d not installed: the torch reference "
                             "for those (pip install 'kiln[hybrid-cuda]')")


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="model.linear_kernels must be one of auto, reference"):
        linear_kernels.choose("fla")


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention importable")
def test_with_flash_linear_attention_installed_a_cpu_model_runs_the_reference(hybrid, monkeypatch):
    """The real package (on a CPU-only box its Triton kernels cannot run): transformers resolved it at
    import; the loaded model's forward still runs, on the torch reference."""
    mq = modeling()
    original = getattr(mq.torch_chunk_gated_delta_rule, linear_kernels._MARK)
    assert linear_kernels._parts(original)[1].__module__.startswith("fla.")
    assert "fla installed, bypassed here" in hybrid.linear_kernels.reason
    got = logits(hybrid.model)
    for attr in PACKAGED:
        monkeypatch.setattr(mq, attr, inspect.unwrap(getattr(mq, attr)))  # the bare torch functions
    torch.testing.assert_close(got, logits(hybrid.model), rtol=0, atol=0)
