"""Which implementation runs a Qwen3.5 hybrid's Gated DeltaNet functions in transformers' forward.

transformers decides at import time: its modeling module wraps the torch reference of the chunked
and the recurrent gated delta rule and of the two causal convolutions in
``use_kernel_func_from_hub_with_fallback``, and when ``fla`` (flash-linear-attention) or
``causal_conv1d`` imports, that package's function replaces the reference for the whole process,
silently. Those are Triton/CUDA kernels: a CPU model (``model.device = "cpu"``, or a CPU box with
the extra installed) would hand them CPU tensors.

:func:`resolve` runs once per loaded hybrid (kiln.runtime.loader). It puts a Kiln dispatcher in
place of each wrapped function of the model's modeling module (once; idempotent): tensors on CUDA
go to transformers' own wrapper (the package kernel where it resolved one) unless
``model.linear_kernels = "reference"``; everything else goes to the torch reference, called the
way transformers calls it (its named parameters only; packed sequences refused). The choice is
per call, by the tensors' device, so a process holding a CPU and a CUDA model stays correct; the
setting is process-wide (the last load that names one decides). :class:`LinearKernels` reports
what was requested and what is in force, per function (``/health``, ``linear_state.kernels``).

On the CPU the engine's generation cycles do not reach these functions at all: they run Kiln's lean
hybrid forward (kiln.runtime.lean_hybrid, ``gated_deltanet.c``); :meth:`LinearKernels.describe`
says so (``effective: "lean-c"``) when the engine uses it. Imports no torch or transformers at
module import.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

SETTINGS = ("auto", "reference")
KERNEL_DEVICES = frozenset({"cuda"})  # device types the package kernels run on
# the name Kiln reports -> (the modeling module's global, the package it comes from)
FUNCTIONS = {
    "chunk_gated_delta_rule": ("torch_chunk_gated_delta_rule", "fla"),
    "fused_recurrent_gated_delta_rule": ("torch_recurrent_gated_delta_rule", "fla"),
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
    "causal_conv1d_update": ("causal_conv1d_update", "causal_conv1d"),
}
DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
LABELS = {"fla": "fla", "causal_conv1d": "causal-conv1d"}
EXTRA = "pip install 'kiln[hybrid-cuda]'"
_MARK = "_kiln_linear_dispatch"
_process = {"packages": True}  # process-wide: model.linear_kernels of the last load that named one


@dataclass(frozen=True)
class LinearKernels:
    """What runs a hybrid's Gated DeltaNet functions in transformers' forward on ``device``."""

    requested: str  # model.linear_kernels: auto | reference
    device: str
    functions: dict[str, str]  # function -> "torch" or the package's import name (fla, causal_conv1d)
    reason: str

    @property
    def effective(self) -> str:
        used = sorted({LABELS.get(v, v) for v in self.functions.values() if v != "torch"})
        return "+".join(used) if used else "reference"

    def describe(self, lean: bool = False) -> dict[str, Any]:
        """The report; ``lean``: the engine's generation cycles run Kiln's lean hybrid forward (CPU)."""
        out = {"requested": self.requested, "effective": self.effective, "functions": dict(self.functions),
               "reason": self.reason}
        if lean:
            out["effective"] = "lean-c"
            out["reason"] = (f"{self.reason}; generation runs Kiln's lean hybrid forward (gated_deltanet.c), "
                             "scoring rows and training run transformers' forward on the torch reference")
        return out


def _closure(fn: Any) -> dict[str, Any]:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    return {name: cell.cell_contents for name, cell in zip(names, cells)}


def _parts(fn: Any) -> tuple[Callable[..., Any] | None, Any]:
    """(the torch reference, the implementation transformers resolved) of one wrapped function;
    the reference is None when the wrapper's shape is not the one this module knows."""
    for _ in range(4):  # transformers' wrapper, possibly under a kernels-hub layer
        free = _closure(fn)
        if "torch_function" in free and "implementation" in free:
            return free["torch_function"], free["implementation"]
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return None, fn


def _package(impl: Any, modeling: str) -> str:
    """``torch`` for a function of transformers' modeling module, else the top package it comes from."""
    module = str(getattr(impl, "__module__", "") or "")
    return "torch" if module == modeling or module.startswith(("transformers.", "kiln.")) else module.split(".")[0]


def _dispatcher(original: Any, reference: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Per call: CUDA tensors (packages allowed) -> transformers' wrapper; else the torch reference."""
    params = frozenset(inspect.signature(reference).parameters)

    @functools.wraps(reference)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if _process["packages"] and first.device.type in KERNEL_DEVICES:
            return original(*args, **kwargs)
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{name}: the torch reference cannot keep packed sequences apart")
        return reference(*args, **{k: v for k, v in kwargs.items() if k in params})

    setattr(dispatch, _MARK, original)
    return dispatch


def _install(module: Any) -> dict[str, str]:
    """Kiln's dispatcher in place of each wrapped function (once); -> what transformers resolved."""
    resolved = {}
    for name, (attr, _package_name) in FUNCTIONS.items():
        current = getattr(module, attr, None)
        if current is None:
            continue
        original = getattr(current, _MARK, current)
        reference, impl = _parts(original)
        resolved[name] = _package(impl, module.__name__)
        if reference is not None and current is original:
            setattr(module, attr, _dispatcher(original, reference, name))
        elif reference is None and resolved[name] != "torch":
            from kiln.runtime.loader import ModelLoadError

            raise ModelLoadError(f"transformers' {module.__name__}.{attr} runs {resolved[name]} and Kiln cannot find "
                                 "its torch reference; uninstall that package or pin the supported transformers")
    return resolved


def _norm(model: Any, modeling: str) -> str | None:
    """What runs a Gated DeltaNet layer's gated RMSNorm (a kernels-hub ``kernelize`` may swap it)."""
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        norm = getattr(getattr(layer, "linear_attn", None), "norm", None)
        if norm is not None:
            return _package(type(norm).forward, modeling)
    return None


def _missing(resolved: dict[str, str]) -> list[str]:
    out = []
    for package in dict.fromkeys(p for _attr, p in FUNCTIONS.values()):
        if any(resolved.get(n) == package for n, (_a, p) in FUNCTIONS.items() if p == package):
            continue
        dist = DISTRIBUTIONS[package]
        try:
            found = importlib.util.find_spec(package) is not None
        except ValueError:  # in sys.modules without a spec
            found = True
        out.append(f"{dist} installed but it did not import" if found else f"{dist} not installed")
    return out


def _reason(requested: str, device: str, resolved: dict[str, str]) -> str:
    kind = device.split(":")[0]
    packages = sorted({v for v in resolved.values() if v != "torch"})
    if kind not in KERNEL_DEVICES:
        bypass = f" ({', '.join(packages)} installed, bypassed here)" if packages else ""
        return f"{device}: the package kernels run on CUDA only; transformers' forward runs the torch reference{bypass}"
    if requested == "reference":
        return "model.linear_kernels = reference"
    missing = _missing(resolved)
    if not missing:
        return "the package kernels on CUDA"
    return "; ".join(missing) + f": the torch reference for those ({EXTRA})"


def choose(setting: str) -> None:
    """``model.linear_kernels`` for this process: ``auto`` (package kernels for CUDA tensors where they
    resolved) or ``reference`` (the torch reference everywhere)."""
    if setting not in SETTINGS:
        raise ValueError(f"model.linear_kernels must be one of {', '.join(SETTINGS)}, not {setting!r}")
    _process["packages"] = setting == "auto"


def resolve(model: Any, device: str, setting: str | None = None) -> LinearKernels | None:
    """Install the dispatch for a loaded model and report it (None: the model has no Gated DeltaNet
    layer). ``setting``: ``model.linear_kernels`` (None keeps the process's current choice)."""
    if setting is not None:
        choose(setting)
    layers = [getattr(layer, "linear_attn", None) for layer in getattr(getattr(model, "model", None), "layers", ())]
    modules = {type(layer).__module__ for layer in layers if layer is not None}
    if not modules:
        return None
    resolved: dict[str, str] = {}
    for name in sorted(modules):
        resolved |= _install(sys.modules[name])
    requested = "auto" if _process["packages"] else "reference"
    in_force = dict(resolved) if requested == "auto" and device.split(":")[0] in KERNEL_DEVICES else \
        {name: "torch" for name in resolved}
    norm = _norm(model, next(iter(sorted(modules))))
    if norm is not None:
        in_force["rms_norm_gated"] = norm
    return LinearKernels(requested=requested, device=device, functions=in_force,
                         reason=_reason(requested, device, resolved))
