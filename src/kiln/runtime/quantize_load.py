"""A quantized load that never holds the whole float model (``model.quantize`` on the CPU).

:func:`load_quantized` builds the model's skeleton with its parameters on the meta device (buffers
such as RoPE's ``inv_freq`` are computed as usual), then reads the checkpoint one tensor at a time
(:class:`_Checkpoint`, plain reads of each tensor's bytes): each linear layer
:func:`kiln.runtime.quantize.quantize_model` would replace is read, quantized and installed as a :class:`~kiln.runtime.quantize.QuantizedLinear`, its
float weight dropped before the next is read; every other tensor (embedding, norms, a hybrid's
conv1d, ``A_log``, ``dt_bias``) is installed in the model's dtype. So the peak is the quantized
model, the float non-linear tensors and one float weight at a time (plus the int8 copy of the LM
head), not the f32 model: a Qwen3.5 of the 4B shape is 15.67 GiB in f32; its int8 server was
ready at 8.48 GiB resident, 9.97 GiB at its peak after an SFT job (docs/serving.md "Quantization").

The probe KL (:func:`kiln.runtime.quantize.mean_kl`) needs the float model's logits: they come from
one forward in which each quantized layer is swapped for one that reads its float weight from the
checkpoint for the call (:class:`_DiskLinear`), before the LM head's int8 copy is made; then the
quantized forward. The probe texts run as one right-padded batch (causal layers: a row's real
tokens never see its padding), so each float weight is read once.

The result is the same model, packed weights and report as ``load_model`` followed by
``quantize_loaded`` (tests/runtime/test_quantize_load.py checks it). A published multimodal Qwen3.5
checkpoint (``Qwen3_5ForConditionalGeneration``) streams too: its ``model.language_model.*`` names map
onto the causal LM's ``model.*`` (:func:`model_name`, the rename transformers applies when it loads
that checkpoint as ``Qwen3_5ForCausalLM``), and the tensors the causal LM lacks (``model.visual.*``,
``mtp.*``) are never read. bf16 (or f16) tensors on disk are converted to the model dtype as they are
read. Checkpoints whose names still do not match take the whole-model path instead:
:func:`missing_tensors` says whether they match.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from kiln.runtime import quantize as q

log = logging.getLogger(__name__)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is refused


class _Checkpoint:
    """The checkpoint's tensors by the causal LM's names (:func:`model_name`) over its safetensors shards,
    read one at a time into memory of
    their own (plain reads, not a memory map: a mapped shard stays resident in the process while any
    tensor from it lives, so the float projections read and quantized would be counted, and kept, with
    the norms beside them; the 4B shape's server held 12 GB of file pages that way)."""

    def __init__(self, model_dir: Path):
        import json

        self.where: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            with open(shard, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if size > MAX_HEADER_BYTES:
                    raise ValueError(f"{shard}: a {size}-byte safetensors header")
                header = json.loads(f.read(size))
            for key, meta in header.items():
                if key != "__metadata__":
                    begin, end = meta["data_offsets"]
                    self.where[model_name(key)] = (shard, meta["dtype"], tuple(meta["shape"]), 8 + size + begin, 8 + size + end)

    def get(self, key: str) -> torch.Tensor:
        path, dtype, shape, begin, end = self.where[key]
        if dtype not in _DTYPES:
            raise ValueError(f"{path.name}: {key} has dtype {dtype}, which this reader does not take")
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        with open(path, "rb", buffering=0) as f:
            f.seek(begin)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{path.name} ends inside {key}")
                done += n
        return buf.view(_DTYPES[dtype]).reshape(shape)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While building a model: each parameter goes to the meta device (no storage), buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(config: Any, dtype: torch.dtype) -> Any:
    """The causal LM of ``config`` with meta parameters (``eval()``), tied as its config says."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


_LANGUAGE_MODEL = "model.language_model."


def model_name(key: str) -> str:
    """The causal LM's name for checkpoint tensor ``key``: a multimodal checkpoint's
    ``model.language_model.X`` is ``model.X``; every other name is unchanged (the vision tower's
    ``model.visual.*`` and ``mtp.*`` then match nothing in the causal LM and are skipped)."""
    return "model." + key[len(_LANGUAGE_MODEL):] if key.startswith(_LANGUAGE_MODEL) else key


def missing_tensors(model: Any, names: set[str]) -> list[str]:
    """The model's state-dict names the checkpoint lacks (a tied LM head's aside): empty when it streams."""
    head = model.get_output_embeddings()
    tied = bool(_text_config(model.config).tie_word_embeddings) and head is not None
    head_key = next((n + ".weight" for n, m in model.named_modules() if m is head), None) if tied else None
    return sorted(k for k in model.state_dict(keep_vars=True) if k not in names and k != head_key)


def _install(model: Any, key: str, value: torch.Tensor) -> None:
    path, _, name = key.rpartition(".")
    mod = model.get_submodule(path)
    if name in mod._parameters:
        old = mod._parameters[name]
        mod._parameters[name] = torch.nn.Parameter(value, requires_grad=bool(old is None or old.requires_grad))
    else:
        mod._buffers[name] = value


def _float_bytes(model: Any) -> int:
    """Bytes of the float model (meta tensors count by shape; tied parameters once)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


class _DiskLinear(torch.nn.Module):
    """A linear layer whose float weight is read from the checkpoint at each call (the probe's reference)."""

    def __init__(self, ckpt: _Checkpoint, key: str, bias: torch.Tensor | None):
        super().__init__()
        self.ckpt, self.key, self.bias = ckpt, key, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.ckpt.get(self.key).to(x.dtype), self.bias)


def load_quantized(spec: Any, mode: str, *, dtype: str = "auto", model_id: str | None = None,
                   info: Any = None, max_kl: float | None = None, kernel: str | None = None) -> Any:
    """A :class:`kiln.runtime.loader.LoadedModel` on the CPU with its linear layers quantized as
    ``mode`` (int8 | int4), built tensor by tensor (module docstring); its ``quantization`` report
    set. Falls back to ``load_model`` + ``quantize_loaded`` where the checkpoint does not stream
    (:func:`missing_tensors`). ``kernel``: a forced kernel (tests). QuantizationRefused above ``max_kl``."""
    from transformers import AutoConfig, AutoTokenizer

    from kiln.runtime.loader import (LoadedModel, ModelLoadError, QuantizationRefused, inspect_model_dir,
                                     load_model, resolve_dtype)
    from kiln.runtime import linear_kernels
    from kiln.runtime.model_family import describe

    if mode not in ("int8", "int4"):
        raise ValueError(f"load_quantized takes int8 or int4, not {mode!r}")
    info = info or inspect_model_dir(spec)
    dt = resolve_dtype(dtype, "cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(info.path, trust_remote_code=False, local_files_only=True)
        config = AutoConfig.from_pretrained(info.path, trust_remote_code=False, local_files_only=True)
        model = skeleton(config, getattr(torch, dt))
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"cannot build {info.path} as a causal language model: {exc}") from exc
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelLoadError(f"{info.path} has no chat template; add chat_template.jinja or use a chat model")
    ckpt = _Checkpoint(info.path)
    missing = missing_tensors(model, set(ckpt.where))
    if missing:
        log.info("%s: tensor names differ from the model's (%s ...): loading whole, then quantizing",
                 info.path, missing[0])
        del model, ckpt
        loaded = load_model(info.path, device="cpu", dtype=dtype, model_id=model_id, info=info)
        q.quantize_loaded(loaded, mode, max_kl)
        return loaded
    family = describe(model, info.config)
    report = _stream_in(model, ckpt, mode, dt, kernel, tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = LoadedModel(model=model, tokenizer=tokenizer, info=info, model_id=model_id or info.path.name,
                         device="cpu", dtype=dt, family=family, quantization=report,
                         linear_kernels=linear_kernels.resolve(model, "cpu"))
    if max_kl is not None and report.probe_kl is not None and report.probe_kl > max_kl:
        raise QuantizationRefused(q.refusal(mode, report, max_kl))
    return loaded


def _stream_in(model: Any, ckpt: _Checkpoint, mode: str, dt: str, kernel: str | None,
               tokenizer: Any) -> q.QuantizationReport:
    """Install every tensor of ``ckpt`` into the meta ``model``, quantizing its linear layers; the report."""
    before = _float_bytes(model)
    targets = q._targets(model)  # (parent, attribute, meta linear), the head excluded
    names = {id(mod): name for name, mod in model.named_modules()}
    keys = {id(lin): names[id(lin)] + ".weight" for _, _, lin in targets}
    target_keys = set(keys.values()) | {k[:-len("weight")] + "bias" for k in keys.values()}
    dtype = getattr(torch, dt)
    with torch.no_grad():
        wanted = set(model.state_dict(keep_vars=True)) - target_keys  # not an MTP head or a vision tower
        for key in ckpt.where:
            if key in wanted:
                _install(model, key, ckpt.get(key).to(dtype))
        if _text_config(model.config).tie_word_embeddings and model.get_output_embeddings() is not None:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        chosen, timings = _choose(mode, targets, ckpt, keys, dtype, kernel)
        int8_aten = mode == "int8" or q.kernel_available("int8", dtype, "cpu")
        counts: dict[str, int] = {}
        float_ref: list[tuple[Any, str, _DiskLinear]] = []
        quantized: list[tuple[Any, str, q.QuantizedLinear]] = []
        for parent, name, lin in targets:
            key = keys[id(lin)]
            bias_key = key[:-len("weight")] + "bias"
            bias = ckpt.get(bias_key).to(dtype) if lin.bias is not None else None
            lin.weight = torch.nn.Parameter(ckpt.get(key).to(dtype), requires_grad=False)
            lin.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            m, kern = q._layer_plan(lin, mode, chosen, int8_aten)
            layer = q.QuantizedLinear(lin, m, kern)
            lin.weight = None  # type: ignore[assignment]  # the float weight goes now
            quantized.append((parent, name, layer))
            float_ref.append((parent, name, _DiskLinear(ckpt, key, bias)))
            counts[m] = counts.get(m, 0) + 1
    leftover = [k for k, v in list(model.named_parameters()) + list(model.named_buffers()) if v.device.type == "meta"]
    if leftover:
        from kiln.runtime.loader import ModelLoadError

        raise ModelLoadError(f"the checkpoint leaves {len(leftover)} tensors unset ({leftover[0]} ...)")
    ids = q._probe_ids(tokenizer)
    for parent, name, disk in float_ref:  # the reference: float weights read from disk, the float head
        parent._modules[name] = disk
    reference = q.batched_logprobs(model, ids)
    for parent, name, layer in quantized:
        parent._modules[name] = layer
    float_layers = sum(1 for mod in model.modules() if type(mod) is torch.nn.Linear)
    head = q.quantize_head(model, chosen)
    kl, tokens = q.mean_kl(reference, q.batched_logprobs(model, ids))
    return q.QuantizationReport(mode, mode, chosen, counts, float_layers, before, q.weight_bytes(model),
                                probe_kl=kl, probe_tokens=tokens, kernel_ms=timings,
                                head="int8" if head else dt)


def _choose(mode: str, targets: list[tuple[Any, str, Any]], ckpt: _Checkpoint, keys: dict[int, str],
            dtype: torch.dtype, kernel: str | None) -> tuple[str, dict[str, float]]:
    """The kernel (:func:`kiln.runtime.quantize.choose_kernel` timed on the largest projection, read alone)."""
    if kernel is not None:
        if kernel != "dequantize" and not q.kernel_available(mode, dtype, "cpu", kernel):
            raise ValueError(f"the {kernel} kernel does not run {mode} for {dtype} on cpu here")
        return kernel, {}
    lin = max((t[2] for t in targets), key=lambda m: m.in_features * m.out_features)
    sample = torch.nn.Linear(lin.in_features, lin.out_features, bias=False, device="meta")
    sample.weight = torch.nn.Parameter(ckpt.get(keys[id(lin)]).to(dtype), requires_grad=False)
    return q.choose_kernel(mode, [sample])
