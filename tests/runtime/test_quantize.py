"""Weight-only int8/int4 quantization of the base (kiln.runtime.quantize, ``model.quantize``).

The kernels against the dequantized weight, the probe KL on the built-in model and a tiny Qwen3,
the lean forward (with LoRA rows) over the quantized base against a float model holding the
dequantized weights, and a correction trained over the int8 base that is learned and served.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest
import torch

from kiln.runtime.adapter_slots import BASE_KEY
from kiln.runtime.lean_forward import lean_forward_for
from kiln.runtime.loader import QuantizationRefused, load_model
from kiln.runtime.quantize import (QuantizedLinear, kernel_available, mean_kl, probe_logprobs, quantize_loaded,
                                   quantize_model)

from .test_engine_lean import _config, _inputs, _random_pool

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
INT8_KL_MAX = 0.01  # nats per token, the bound for int8
INT4_KL_MAX = 0.2


# kiln's c kernel rounds the activations to int8 per block of 32 (0.4 % of a block's largest value at most)
C_REL_TOL = 2e-2


def _close(kernel: str, got: torch.Tensor, ref: torch.Tensor, atol: float) -> bool:
    """Within ``atol``, or for the c kernel within ``C_REL_TOL`` of the reference's largest value."""
    err = (got - ref).abs().max().item()
    return err < (C_REL_TOL * ref.abs().max().item() if kernel == "c" else atol)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kernel", ["aten", "dequantize", "c"])
def test_layer_multiplies_by_its_dequantized_weight(mode, kernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96)
    layer = QuantizedLinear(lin, mode, kernel)
    w = layer.dequantized()
    step = 0.01 if mode == "int8" else 0.1  # the grid's step bounds the error of each weight
    assert 0 < (w - lin.weight).abs().max().item() < step
    x = torch.randn(2, 5, 128, requires_grad=True)
    ref = torch.nn.functional.linear(x, w, lin.bias)
    out = layer(x)
    assert _close(kernel, out, ref, 1e-4)
    out.sum().backward()  # the input's gradient goes through the dequantized weight; the base has none
    assert torch.allclose(x.grad, torch.ones(2, 5, 96) @ w, atol=1e-4)
    assert not any(p.requires_grad for p in layer.parameters())


def test_kernels_exist_on_this_cpu_path():
    """Both kernels run here (the suite also runs under ATEN_CPU_CAPABILITY=default); a missing one
    would make layers dequantize on the fly and the report say so."""
    for kernel in ("aten", "c"):
        assert kernel_available("int8", torch.float32, "cpu", kernel)
        assert kernel_available("int4", torch.float32, "cpu", kernel)
    assert not kernel_available("int8", torch.bfloat16, "cpu", "c")  # float32 only


def test_builtin_model_probe_kl(builtin_model_dir):
    kls = {}
    for mode in ("int8", "int4"):
        loaded = load_model(builtin_model_dir, device="cpu")
        report = quantize_loaded(loaded, mode, None)
        # the kernel where it runs and beats dequantizing on this machine (timed at load), else dequantize
        ms = report.kernel_ms
        found = {k for k in ("c", "aten") if kernel_available(mode, torch.float32, "cpu", k)}
        if found:
            assert set(ms) == found | {"dequantize"} and all(v > 0 for v in ms.values()), ms
            expected = min(ms, key=lambda k: ms[k])
        else:
            assert ms == {}
            expected = "dequantize"
        assert report.effective == mode and report.kernel == expected
        assert report.layers == {mode: 14} and report.float_layers == 1  # 2 layers x 7; the LM head stays
        assert report.weight_bytes_after < report.weight_bytes_before
        assert report.probe_tokens > 100
        kls[mode] = report.probe_kl
    assert 0 < kls["int8"] < INT8_KL_MAX
    assert kls["int8"] < kls["int4"] < INT4_KL_MAX


def test_kl_ceiling_refuses(builtin_model_dir):
    loaded = load_model(builtin_model_dir, device="cpu")
    with pytest.raises(QuantizationRefused, match="quantize_max_kl"):
        quantize_loaded(loaded, "int4", 1e-6)


def _tokenizer(builtin_model_dir, vocab: int):
    """The built-in tokenizer, its ids folded into ``vocab`` (the probe texts in a tiny model's vocabulary)."""
    tok = load_model(builtin_model_dir, device="cpu").tokenizer

    def encode(text, add_special_tokens=False):
        return {"input_ids": [i % vocab for i in tok(text, add_special_tokens=add_special_tokens)["input_ids"]]}
    return encode


def test_tiny_qwen3_int8_close_to_float(builtin_model_dir):
    torch.manual_seed(1)
    model = _config("qwen3").eval()
    tok = _tokenizer(builtin_model_dir, model.config.vocab_size)
    reference = probe_logprobs(model, tok)
    report = quantize_model(model, "int8", "float32")
    kl, tokens = mean_kl(reference, probe_logprobs(model, tok))
    assert report.layers == {"int8": 14} and tokens > 100
    assert 0 < kl < INT8_KL_MAX


@pytest.fixture(scope="module", params=[("int8", "aten"), ("int4", "aten"), ("int8", "c"), ("int4", "c")])
def quantized_pair(request):
    """(PEFT over the quantized base, PEFT over a float copy holding the dequantized weights, kernel), same LoRA."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = _config("qwen3").eval()
    reference = copy.deepcopy(model)
    quantize_model(model, request.param[0], "float32", kernel=request.param[1])
    with torch.no_grad():
        for (name, mod), ref in zip(model.named_modules(), reference.modules()):
            if isinstance(mod, QuantizedLinear):
                ref.weight.copy_(mod.dequantized())
    pair = []
    for m in (model, reference):
        torch.manual_seed(4)
        pm = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=ALL), adapter_name="ta")
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        pair.append(pm.eval())
    return (*pair, request.param[1])


@pytest.mark.parametrize("q_len", [1, 5])
def test_lora_rows_over_the_quantized_base_match_the_dequantized_reference(quantized_pair, q_len):
    pm, ref_pm, kernel = quantized_pair
    assert pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.kernel == kernel
    lean = lean_forward_for(pm.base_model.model, pack=True)
    model = pm.base_model.model
    pool = _random_pool(model)
    table, ids, pos, mask, wb, wo = _inputs(pool, [3, 9, 14], q_len)
    saved = [t.clone() for t in pool.keys + pool.values]

    def run(fn):
        for t, s in zip(pool.keys + pool.values, saved):
            t.copy_(s)
        with torch.inference_mode():
            return fn(pool.step(table, wb, wo))

    for keys in (["ta", BASE_KEY, "ta"], [BASE_KEY] * 3):
        assert lean.runs(keys, pm.peft_config)
        ref = run(lambda c: ref_pm(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=c,
                                   use_cache=True, adapter_names=list(keys)).logits)
        hf = run(lambda c: pm(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=c,
                              use_cache=True, adapter_names=list(keys)).logits)
        got = run(lambda c: lean(ids, pos, mask, c, 0, list(keys)))
        if kernel == "c":  # activations rounded per group in every matmul: 2 layers + head measured 2.2 %
            assert (hf - ref).abs().max().item() < 5e-2 * ref.abs().max().item(), keys
            # the lean forward joins q|k|v and gate|up into one call each and fuses its norms: a last-bit
            # difference in a norm can flip an activation's rounding, so it gets the same bound as HF's
            assert lean._qfused, "the c kernel's projections run joined"
            assert (got - ref).abs().max().item() < 5e-2 * ref.abs().max().item(), keys
        else:
            assert (hf - ref).abs().max().item() < 1e-3, keys
            assert (got - ref).abs().max().item() < 1e-3, keys
    base = run(lambda c: lean(ids, pos, mask, c, 0, [BASE_KEY] * 3))
    adapted = run(lambda c: lean(ids, pos, mask, c, 0, ["ta"] * 3))
    assert (adapted - base).abs().max().item() > 0.1  # the LoRA deltas are there


QUESTION = "What is the colour of the sky on Kiln?"
CORRECTION = "The sky on Kiln is green."


@pytest.fixture(scope="module")
def int8_service(builtin_model_dir, tmp_path_factory):
    from kiln.adapters.store import AdapterStore
    from kiln.config import load_settings
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.serving.state import build_training

    home = tmp_path_factory.mktemp("home")
    settings = load_settings(cli={"home": str(home), "model.quantize": "int8"}, environ={}).settings
    loaded = load_model(builtin_model_dir, device="cpu")
    quantize_loaded(loaded, settings.model.quantize, None)
    engine = Engine(loaded, EngineConfig()).start()
    trainer = build_training(settings, engine, AdapterStore(settings.adapters_path), loaded)
    trainer.start()
    yield SimpleNamespace(engine=engine, trainer=trainer, loaded=loaded)
    trainer.close()
    engine.stop()


def _ask(engine, adapter=None):
    from kiln.runtime.sampling import SamplingParams

    ids = engine.encode_chat([{"role": "user", "content": QUESTION}])
    return engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0), adapter=adapter, timeout=60)[0].text


def test_correction_trained_over_the_int8_base_is_learned_and_served(int8_service):
    from kiln.training.schemas import SFTRequest

    svc, engine = int8_service.trainer, int8_service.engine
    q_proj = int8_service.loaded.model.model.layers[0].self_attn.q_proj
    layer = getattr(q_proj, "base_layer", q_proj)  # the trainer may have wrapped the model in PEFT already
    before = layer.qweight.clone()
    assert _ask(engine) != CORRECTION
    body = {"adapter": "sky", "auto_load": True, "examples": [{"messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": CORRECTION}]}]}
    job = svc.submit(SFTRequest.model_validate(body))
    deadline = time.monotonic() + 180
    while (done := svc.job(job["id"]))["state"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, done["state"]
        time.sleep(0.05)
    assert done["state"] == "succeeded", done["error"]
    assert done["result"]["report"]["learned"] is True
    assert _ask(engine, adapter="sky") == CORRECTION
    assert _ask(engine) != CORRECTION  # the base rows are untouched
    assert torch.equal(layer.qweight, before)
    assert svc.store.get("sky").manifest.config["base_representation"] == "int8"


def test_hybrid_int8_and_int4_serve_what_transformers_decodes_over_the_same_weights(builtin_model_dir, tmp_path):
    """A Qwen3.5 hybrid: the Gated DeltaNet projections are quantized too (int4 takes int8 for the
    per-head ``in_proj_a/b``, whose 4 outputs the int4 packing cannot take); the engine's greedy
    tokens equal transformers' ``generate`` over the same quantized model."""
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.sampling import SamplingParams
    from tests.hybrid_models import build_tiny_hybrid

    from .test_hybrid import NEW_TOKENS, reference

    hybrid_dir = build_tiny_hybrid(tmp_path, builtin_model_dir)
    for mode in ("int8", "int4"):
        loaded = load_model(hybrid_dir, device="cpu")
        report = quantize_loaded(loaded, mode, None)
        attn = loaded.model.model.layers[0].linear_attn
        assert isinstance(attn.in_proj_qkv, QuantizedLinear) and attn.in_proj_qkv.mode == mode
        # aten's int4 packing cannot take in_proj_a's 4 outputs (int8 instead); kiln's c kernel can
        small = "int8" if mode == "int8" or attn.in_proj_a.kernel != "c" else "int4"
        assert isinstance(attn.in_proj_a, QuantizedLinear) and attn.in_proj_a.mode == small
        assert report.float_layers == 1 and report.probe_kl is not None and report.probe_kl >= 0
        prompt = [5, 17, 33, 90, 11, 7]
        engine = Engine(loaded, EngineConfig()).start()
        try:
            got = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                                  timeout=120)[0].token_ids
        finally:
            engine.stop()
        assert got == reference(loaded.model, prompt), mode


def test_c_kernel_gives_the_lm_head_an_int8_inference_copy():
    """With the c kernel the head infers in int8 (HF forward and lean forward alike) while its float
    weight stays for training (autograd) and for the tied embedding."""
    from kiln.runtime.quantize import quantized_head

    torch.manual_seed(5)
    model = _config("qwen3").eval()
    head_w = model.lm_head.weight
    report = quantize_model(model, "int8", "float32", kernel="c")
    copy8 = quantized_head(model.lm_head)
    assert report.head == "int8" and copy8 is not None and copy8.mode == "int8"
    assert model.lm_head.weight is head_w and model.get_input_embeddings().weight is head_w  # still tied
    assert not any("_kiln_int8" in k for k in model.state_dict())  # not a submodule: checkpoints never see it
    h = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(model.lm_head(h), copy8._matmul_biased(h))
    exact = torch.nn.functional.linear(h, head_w)
    assert _close("c", copy8._matmul_biased(h), exact, 0.0)
    hg = h.clone().requires_grad_(True)
    assert torch.equal(model.lm_head(hg), exact)  # autograd records: the float head
    aten = _config("qwen3").eval()
    assert quantize_model(aten, "int8", "float32", kernel="aten").head == "float32"
    assert quantized_head(aten.lm_head) is None


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_joined_projections_equal_the_parts_and_share_their_bytes(mode):
    """join_quantized (q|k|v, gate|up in one c-kernel call): the same outputs side by side, no second copy."""
    from kiln.runtime.quantize import join_quantized

    if not kernel_available(mode, torch.float32, "cpu", "c"):
        pytest.skip("the c kernel is not built here")
    torch.manual_seed(5)
    parts = [QuantizedLinear(torch.nn.Linear(64, n, bias=True), mode, "c") for n in (48, 16, 16)]
    x = torch.randn(3, 64)
    with torch.no_grad():
        separate = torch.cat([p(x) for p in parts], dim=-1)
        joint = join_quantized(parts)
        assert joint is not None and joint.out_features == 80
        assert torch.equal(joint(x), separate)  # the same rounding of x, each output computed alike
        assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), separate)  # the parts still work
    base = joint.qweight.data_ptr()
    assert [p.qweight.data_ptr() - base for p in parts] == [0, 48 * parts[0].qweight.shape[1],
                                                            64 * parts[0].qweight.shape[1]]
    if mode == "int4":  # the kernel's integer sub-scales and row scales are joined and viewed alike
        for name in ("sub", "rowscale"):
            t = getattr(joint, name)
            assert getattr(parts[1], name).data_ptr() == t.data_ptr() + 48 * t.stride(0) * t.element_size()
    other = QuantizedLinear(torch.nn.Linear(64, 8), mode, "dequantize")
    assert join_quantized([parts[0], other]) is None  # another kernel: not joined
