"""Weight-only quantization of a loaded model's linear layers (``model.quantize``: none | int8 | int4).

At load, each ``nn.Linear`` of the decoder (attention, MLP and a hybrid's Gated DeltaNet projections;
the embedding and the LM head stay in the model's dtype) is replaced by a :class:`QuantizedLinear`
holding only the quantized weight; activations stay in the model's dtype:

* ``int8``: per-output-channel symmetric int8 (``scale = max|w| / 127`` per row).
* ``int4``: group-wise asymmetric 4-bit (groups of ``INT4_GROUP`` input features, a scale and a zero
  per group: ``w = (q - 8) * scale + zero``).

Three kernels (:data:`KERNELS`), one chosen per load by measurement: ``c``, Kiln's own
(kiln.runtime.quant_matmul: activations rounded to int8 per group, integer dots by
AVX-512 VNNI / AVX2 / portable C; float32 on the CPU, in-features a multiple of 32); ``aten``,
torch's ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` (int4 packed once by
``_convert_weight_to_int4pack_for_cpu``); ``dequantize``, ``F.linear`` over the weight dequantized on
the fly. Each candidate that runs here (a tiny checked call) is timed on the model's largest
projection (8 rows, the median of 7 calls) and the fastest is used, reported with every timing
(``kernel_ms``). A layer whose shape the chosen int4 layout cannot take (in-features not a multiple of
the group; for ``aten`` also out-features not a multiple of 16: a hybrid's per-head ``in_proj_a/b``)
is quantized as int8 and counted in the report's ``layers``. With ``c``, the LM head also gets an int8
inference copy (:func:`quantize_head`; the float head stays for training and the tied embedding).

:class:`QuantizedLinear` subclasses ``nn.Linear`` (no ``weight`` parameter: ``qweight`` and its scales
are buffers) so PEFT wraps it as a LoRA ``base_layer``: served rows and training get f32 LoRA over the
quantized base; the base's backward passes the input's gradient through the dequantized weight and
never gives the base a gradient.

:func:`probe_kl` measures the mean per-token KL(float || quantized) of next-token distributions on a
fixed probe set (``PROBE_TEXTS`` in the model's own tokenizer), computed before the float weights
are dropped; ``model.quantize_max_kl`` refuses a load that exceeds it (kiln.runtime.loader).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kiln.runtime import quant_matmul

MODES = ("none", "int8", "int4")
KERNELS = ("c", "aten", "dequantize")  # kiln.runtime.quant_matmul, torch's packed kernels, dequantize on the fly
INT4_GROUP = 32  # input features per int4 scale/zero
INT4_N_MULTIPLE = 16  # the CPU int4 packing takes out-features in multiples of this (else: int8)
INT4_INNER_K_TILES = 2  # the CPU int4 packing's K tiling (1, 2 or 4; the kernel takes any)
PROBE_TEXTS = (  # fixed, so the KL of two loads of one model compares
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Question: What is the capital of France? Answer: The capital of France is Paris, which",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584,",
)
PROBE_MAX_TOKENS = 48


INT8_CHUNK_ROWS = 4096  # rows quantized at a time: a 248,320-row LM head needs no full-size float temporaries


def _quant_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [N, K], scales [N])``: symmetric per output channel (in row chunks: each row is independent)."""
    w = w.detach()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r in range(0, w.shape[0], INT8_CHUNK_ROWS):
        part = w[r:r + INT8_CHUNK_ROWS].float()
        s = (part.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q[r:r + INT8_CHUNK_ROWS] = torch.round(part / s[:, None]).clamp(-127, 127).to(torch.int8)
        scales[r:r + INT8_CHUNK_ROWS] = s
    return q, scales


def _quant_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int32 codes 0..15 [N, K], scale_zeros [K / group, N, 2])``: asymmetric per group of in-features."""
    n, k = w.shape
    wg = w.detach().float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = quant_matmul.snap_int4_scales(((hi - lo) / 15.0).clamp(min=1e-12))  # the c kernel's integer sub-scales
    codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + scale * 8.0  # the kernel's dequantization: (q - 8) * scale + zero
    return codes, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


class _QuantMatmul(torch.autograd.Function):
    """``x @ W.T`` by the layer's kernel; backward passes only the input's gradient (the base is frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: "QuantizedLinear") -> torch.Tensor:
        ctx.layer = layer
        return layer._matmul(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        w = ctx.layer.dequantized().to(grad.dtype)
        return grad @ w, None


class QuantizedLinear(torch.nn.Linear):
    """A frozen ``nn.Linear`` stored as int8 or int4 (see the module docstring); ``kernel`` is one of
    :data:`KERNELS` (``True``/``False`` are accepted for ``aten``/``dequantize``)."""

    def __init__(self, linear: torch.nn.Linear, mode: str, kernel: str | bool):
        torch.nn.Module.__init__(self)  # not nn.Linear's: no float weight is allocated
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if isinstance(kernel, bool):
            kernel = "aten" if kernel else "dequantize"
        if kernel not in KERNELS:
            raise ValueError(f"unknown quantized kernel {kernel!r} (one of {', '.join(KERNELS)})")
        self.mode, self.kernel = mode, str(kernel)
        self.float_dtype = linear.weight.dtype
        w = linear.weight
        if mode == "int8":
            q, scales = _quant_int8(w)
            self.register_buffer("qweight", q.to(w.device))
            self.register_buffer("scales", scales.to(w.device, self.float_dtype))
        else:
            codes, sz = _quant_int4(w, INT4_GROUP)
            if kernel == "aten":  # aten's packed layout
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.cpu(), INT4_INNER_K_TILES)
            elif kernel == "c":  # two codes a byte, scales [N, K / 32, 2], sub-scales (kiln.runtime.quant_matmul)
                packed, sz = quant_matmul.pack_int4(codes), sz.transpose(0, 1).contiguous()
                sub, rowscale = quant_matmul.int4_subscales(sz)
                self.register_buffer("sub", sub.to(w.device))
                self.register_buffer("rowscale", rowscale.to(w.device))
            else:  # dequantize: the codes themselves, one a byte
                packed = codes.to(torch.uint8)
            self.register_buffer("qweight", packed.to(w.device))
            self.register_buffer("scales", sz.to(w.device, self.float_dtype))
        self.register_parameter("weight", None)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                       requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[N, K]`` in the model's dtype (tests' reference; backward)."""
        if self.mode == "int8":
            return (self.qweight.float() * self.scales.float()[:, None]).to(self.float_dtype)
        n, k = self.out_features, self.in_features
        if self.kernel == "c":
            codes = quant_matmul.unpack_int4(self.qweight).float().reshape(n, k // INT4_GROUP, INT4_GROUP)
            sc = self.scales.float()
            return ((codes - 8.0) * sc[..., 0:1] + sc[..., 1:2]).reshape(n, k).to(self.float_dtype)
        if self.kernel == "aten":  # recover the codes: the packed kernel times the identity gives the dequantized rows
            eye = torch.eye(k, dtype=self.float_dtype, device=self.qweight.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, INT4_GROUP, self.scales).T.contiguous()
        sz = self.scales.float()  # [K / g, N, 2]
        codes = self.qweight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
        w = (codes - 8.0) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]
        return w.reshape(n, k).to(self.float_dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.kernel == "c":
            kern = quant_matmul.load()
            assert kern is not None, "the c kernel is chosen only where it loaded"
            sub = (self.sub, self.rowscale) if self.mode == "int4" else None
            out = kern.matmul(x2, self.qweight, self.scales, self.mode, threads=torch.get_num_threads(), sub=sub)
        elif self.kernel == "dequantize":
            out = F.linear(x2, self.dequantized())
        elif self.mode == "int8":
            out = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, INT4_GROUP, self.scales)
        return out.reshape(*shape[:-1], self.out_features)

    def _matmul_biased(self, x: torch.Tensor) -> torch.Tensor:
        """Inference only (no autograd): the kernel's product plus the bias."""
        out = self._matmul(x)
        return out if self.bias is None else out.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self._matmul_biased(x)
        out = _QuantMatmul.apply(x, self)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, " \
               f"kernel={self.kernel}"


def join_quantized(parts: list[QuantizedLinear]) -> QuantizedLinear | None:
    """One c-kernel layer whose outputs are ``parts``' side by side (q|k|v, gate|up: one activation
    rounding and one call instead of one per part), or ``None`` when they cannot join (another kernel,
    mixed modes or in-features, a bias on some parts only).

    The joint buffers are new; each part's ``qweight`` and ``scales`` become views of them (rows along
    dim 0), so the join costs no memory and the parts (PEFT's base layers, training) read the same bytes."""
    first = parts[0]
    if any(p.kernel != "c" or p.mode != first.mode or p.in_features != first.in_features
           or p.scales.dtype != first.scales.dtype for p in parts):
        return None
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    joint = QuantizedLinear.__new__(QuantizedLinear)
    torch.nn.Module.__init__(joint)
    joint.in_features, joint.out_features = first.in_features, sum(p.out_features for p in parts)
    joint.mode, joint.kernel, joint.float_dtype = first.mode, "c", first.float_dtype
    joint.register_buffer("qweight", torch.cat([p.qweight for p in parts]))
    joint.register_buffer("scales", torch.cat([p.scales for p in parts]))
    extra = ("sub", "rowscale") if first.mode == "int4" else ()
    for name in extra:
        joint.register_buffer(name, torch.cat([getattr(p, name) for p in parts]))
    joint.register_parameter("weight", None)
    joint.bias = None if biases[0] is None else torch.nn.Parameter(
        torch.cat([b.detach() for b in biases if b is not None]), requires_grad=False)
    row = 0
    for p in parts:
        p._buffers["qweight"] = joint.qweight[row:row + p.out_features]
        p._buffers["scales"] = joint.scales[row:row + p.out_features]
        for name in extra:
            p._buffers[name] = getattr(joint, name)[row:row + p.out_features]
        row += p.out_features
    return joint


def _int4_fits(lin: torch.nn.Linear, kernel: str) -> bool:
    """Shapes int4 takes: whole groups of in-features; out-features a multiple of 16 too except for the c kernel."""
    return lin.in_features % INT4_GROUP == 0 and (kernel == "c" or lin.out_features % INT4_N_MULTIPLE == 0)


def kernel_available(mode: str, dtype: torch.dtype, device: str, kernel: str = "aten") -> bool:
    """Whether ``kernel`` (``aten`` or ``c``) runs ``mode`` for ``dtype`` on ``device`` here (one tiny call)."""
    if kernel == "c" and (dtype != torch.float32 or device != "cpu" or quant_matmul.load() is None):
        return False
    g = torch.Generator().manual_seed(0)  # the caller's RNG state is left alone
    try:
        lin = torch.nn.Linear(64, 16, bias=False, device="meta")
        lin.weight = torch.nn.Parameter(torch.randn(16, 64, generator=g).to(device, dtype), requires_grad=False)
        layer = QuantizedLinear(lin, mode, kernel=kernel)
        x = torch.randn(3, 64, generator=g).to(device, dtype)
        ref = F.linear(x, layer.dequantized())
        # c rounds the activations to int8 per block of 32: about 0.4 % of the block's largest value
        return bool((layer._matmul(x) - ref).abs().max() <= 2e-2 * ref.abs().max())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError):
        return False


def kernel_timings(mode: str, lin: torch.nn.Linear, rows: int = 8, calls: int = 7,
                   kernels: tuple[str, ...] = ("aten", "dequantize")) -> dict[str, float]:
    """Milliseconds per ``[rows, K] @ W.T`` of ``lin`` quantized as ``mode`` by each of ``kernels`` (the
    median of ``calls`` after one warm-up call each)."""
    import statistics
    import time

    x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(0)).to(lin.weight)
    out: dict[str, float] = {}
    with torch.no_grad():
        for name in kernels:
            layer = QuantizedLinear(lin, mode, kernel=name)
            layer._matmul(x)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                layer._matmul(x)
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = round(statistics.median(times), 3)
    return out


def choose_kernel(mode: str, targets: list[torch.nn.Linear]) -> tuple[str, dict[str, float]]:
    """The fastest kernel for ``mode`` on the largest projection that every candidate takes, and the timings.
    Candidates: ``c`` and ``aten`` where they run here (a tiny checked call each), ``dequantize`` always."""
    sample = targets[0].weight
    found = [k for k in ("c", "aten") if kernel_available(mode, sample.dtype, str(sample.device), k)]
    fits = [lin for lin in targets if lin.in_features % INT4_GROUP == 0
            and (mode == "int8" or _int4_fits(lin, "aten" if "aten" in found else "c"))]
    if not found or not fits:
        return "dequantize", {}
    timings = kernel_timings(mode, max(fits, key=lambda lin: lin.weight.numel()), kernels=(*found, "dequantize"))
    return min(timings, key=lambda k: timings[k]), timings


def _layer_plan(lin: torch.nn.Linear, mode: str, chosen: str, int8_aten: bool) -> tuple[str, str]:
    """``(mode, kernel)`` of one layer: int8 where int4 cannot take its shape; dequantize where its kernel cannot."""
    m = mode if mode == "int8" or _int4_fits(lin, chosen) else "int8"
    if chosen == "c":
        return m, "c" if lin.in_features % INT4_GROUP == 0 else "dequantize"
    if chosen == "aten" and (m == mode or int8_aten):
        return m, "aten"
    return m, "dequantize"


@dataclass
class QuantizationReport:
    """What a load did: ``/health``, ``/v1/config`` and adapter manifests show it (:meth:`as_dict`)."""

    requested: str
    effective: str  # the base representation: float32 | bfloat16 | float16 | int8 | int4 (int8 where int4 could not)
    kernel: str | None = None  # c | aten | dequantize (the measured choice) | None (none requested)
    layers: dict[str, int] = field(default_factory=dict)  # quantized layers per mode
    float_layers: int = 0  # linear layers kept in the model's dtype (the LM head)
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    probe_kl: float | None = None  # mean per-token KL(float || quantized), nats
    probe_tokens: int = 0
    kernel_ms: dict[str, float] = field(default_factory=dict)  # the choice's timings per candidate, ms
    head: str | None = None  # the LM head's inference representation: int8 (quantize_head) or the model's dtype

    def as_dict(self) -> dict[str, Any]:
        return {"requested": self.requested, "effective": self.effective, "kernel": self.kernel,
                "layers": dict(self.layers), "float_layers": self.float_layers,
                "weight_bytes_before": self.weight_bytes_before, "weight_bytes_after": self.weight_bytes_after,
                "probe_kl": self.probe_kl, "probe_tokens": self.probe_tokens, "kernel_ms": dict(self.kernel_ms),
                "head": self.head}


def weight_bytes(model: Any) -> int:
    """Bytes of ``model``'s parameters and buffers (each storage once) plus any int8 head copy
    (:func:`quantize_head`): what the weights hold resident (memory admission counts this)."""
    seen: set[int] = set()
    total = 0
    copy8 = quantized_head(model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None
    extra = [] if copy8 is None else [copy8.qweight, copy8.scales]
    for t in list(model.parameters()) + list(model.buffers()) + extra:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _targets(model: Any) -> list[tuple[Any, str, torch.nn.Linear]]:
    """``(parent, attribute, linear)`` of each plain float ``nn.Linear`` except the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if type(child) is torch.nn.Linear and child is not head and child.weight.is_floating_point():
                out.append((parent, name, child))
    return out


def quantize_model(model: Any, mode: str, dtype_name: str, kernel: str | None = None) -> QuantizationReport:
    """Replace ``model``'s linear layers in place (``mode`` in :data:`MODES`); the report of what it did.
    ``kernel`` (tests, benchmarks): use that candidate of :data:`KERNELS` instead of the measured choice."""
    before = weight_bytes(model)
    if mode == "none":
        return QuantizationReport(mode, dtype_name, weight_bytes_before=before, weight_bytes_after=before)
    targets = _targets(model)
    if not targets:
        return QuantizationReport(mode, dtype_name, weight_bytes_before=before, weight_bytes_after=before)
    sample = targets[0][2].weight
    if kernel is None:
        chosen, timings = choose_kernel(mode, [lin for _, _, lin in targets])
    elif kernel == "dequantize" or kernel_available(mode, sample.dtype, str(sample.device), kernel):
        chosen, timings = kernel, {}
    else:
        raise ValueError(f"the {kernel} kernel does not run {mode} for {sample.dtype} on {sample.device} here")
    int8_aten = mode == "int8" or kernel_available("int8", sample.dtype, str(sample.device))
    counts: dict[str, int] = {}
    with torch.no_grad():
        for parent, name, lin in targets:
            m, kernel = _layer_plan(lin, mode, chosen, int8_aten)
            parent._modules[name] = QuantizedLinear(lin, m, kernel)
            counts[m] = counts.get(m, 0) + 1
    float_layers = sum(1 for mod in model.modules() if type(mod) is torch.nn.Linear)
    head = quantize_head(model, chosen)
    return QuantizationReport(mode, mode, chosen, counts, float_layers, before, weight_bytes(model),
                              kernel_ms=timings, head="int8" if head else dtype_name)


def _head_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The LM head's forward once :func:`quantize_head` ran: the int8 copy for inference, the float
    weight where autograd records (training keeps the exact head; the base gets no gradient either way)."""
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return F.linear(x, self.weight, self.bias)
    return quantized_head(self)._matmul_biased(x)  # type: ignore[union-attr]


def quantized_head(head: Any) -> QuantizedLinear | None:
    """The int8 inference copy :func:`quantize_head` gave ``head``, if any (the lean forward uses it)."""
    return getattr(head, "_kiln_int8", None)


def quantize_head(model: Any, kernel: str) -> bool:
    """With the c kernel, give the LM head an int8 inference copy (whether it did).

    The float head stays (tied to the embedding in most checkpoints, and read as ``.weight`` by
    training's chunked loss and distillation), so this costs memory (N x K bytes) and buys speed: at
    c=8 on qwen3-31m the f32 head was as much work as all int8 projections together. The copy is a
    plain attribute, not a submodule: state dicts, ``modules()`` and PEFT do not see it."""
    head: Any = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if kernel != "c" or type(head) is not torch.nn.Linear or head.in_features % INT4_GROUP \
            or head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
        return False
    import types

    q = QuantizedLinear(head, "int8", "c")
    object.__setattr__(head, "_kiln_int8", q)
    head.forward = types.MethodType(_head_forward, head)
    return True


def _probe_ids(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"])[:PROBE_MAX_TOKENS] for text in PROBE_TEXTS]


def probe_logprobs(model: Any, tokenizer: Any) -> list[torch.Tensor]:
    """Next-token log-probabilities ``[tokens, vocab]`` of each probe text (float64)."""
    return batched_logprobs(model, _probe_ids(tokenizer))


def batched_logprobs(model: Any, ids: list[list[int]]) -> list[torch.Tensor]:
    """Next-token log-probabilities (float64, ``[len, vocab]``) of each non-empty row of ``ids``, run as one
    right-padded batch (a row's real tokens never attend to its padding in a causal model), so each weight is
    read once: the streamed load (:mod:`kiln.runtime.quantize_load`) reads its float weights from disk."""
    rows = [r for r in ids if r]
    if not rows:
        return []
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, :len(r)] = torch.tensor(r)
    with torch.no_grad():
        logits = model(input_ids=batch.to(next(model.parameters()).device)).logits
    return [torch.log_softmax(logits[i, :len(r)].double(), dim=-1) for i, r in enumerate(rows)]


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> tuple[float, int]:
    """Mean per-token KL(reference || other) in nats over the probe tokens, and the token count.

    In float64 (log-probabilities taken from the logits in float64 too): in float32 the sum over a
    248,320-token vocabulary of terms near 1e-9 is rounding noise, and came out negative."""
    total, tokens = 0.0, 0
    for p, q in zip(reference, other):
        p, q = p.double(), q.double()
        total += float((p.exp() * (p - q)).sum())
        tokens += p.shape[0]
    return (total / tokens if tokens else 0.0), tokens


def quantize_with_probe(model: Any, tokenizer: Any, mode: str, dtype_name: str) -> QuantizationReport:
    """:func:`quantize_model` with the probe KL measured (the float logits are taken first)."""
    if mode == "none":
        return quantize_model(model, mode, dtype_name)
    reference = probe_logprobs(model, tokenizer)
    report = quantize_model(model, mode, dtype_name)
    report.probe_kl, report.probe_tokens = mean_kl(reference, probe_logprobs(model, tokenizer))
    return report


def quantize_loaded(loaded: Any, mode: str, max_kl: float | None) -> QuantizationReport:
    """Quantize a :class:`kiln.runtime.loader.LoadedModel` in place and record the report on it;
    :class:`QuantizationRefused` when the probe KL exceeds ``max_kl`` (the model is then unusable)."""
    from kiln.runtime.loader import QuantizationRefused

    report = quantize_with_probe(loaded.model, loaded.tokenizer, mode, loaded.dtype)
    loaded.quantization = report
    if max_kl is not None and report.probe_kl is not None and report.probe_kl > max_kl:
        raise QuantizationRefused(refusal(mode, report, max_kl))
    return report


def refusal(mode: str, report: QuantizationReport, max_kl: float) -> str:
    """Why a load whose probe KL exceeds ``model.quantize_max_kl`` is refused (QuantizationRefused's message)."""
    return (f"--quantize {mode}: the probe set's mean per-token KL(float || {mode}) is {report.probe_kl:.4g} nats "
            f"over {report.probe_tokens} tokens, above model.quantize_max_kl = {max_kl}; serve a wider "
            f"representation (int8, none) or raise the ceiling")
