"""The streamed quantized load (kiln.runtime.quantize_load): the same model as quantizing a fully
loaded one, without ever holding the float linear weights together; the probe KL in float64; the
int8 head copy without a packed float one; ``--quantize`` with the vLLM engine refused before any load;
and (slow lane) bench/big_hybrid.py's path end to end on a scaled-down Qwen3.5 hybrid."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from kiln.config import ConfigError, load_settings
from kiln.runtime.loader import load_model
from kiln.runtime.quantize import QuantizedLinear, mean_kl, quantize_loaded, quantized_head
from kiln.runtime.quantize_load import load_quantized

ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([[5, 17, 33, 90, 11, 7, 64, 3]])


@pytest.fixture(scope="module")
def hybrid_dir(builtin_model_dir, tmp_path_factory):
    from tests.hybrid_models import build_tiny_hybrid

    return build_tiny_hybrid(tmp_path_factory.mktemp("hybrid"), builtin_model_dir)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_streamed_load_equals_quantizing_the_loaded_model(kind, mode, builtin_model_dir, hybrid_dir):
    """Same packed weights (every tensor of the state dict), same logits, same report; the KL agrees
    (the streamed probe runs the texts as one padded batch) and is positive."""
    model_dir = builtin_model_dir if kind == "attention" else hybrid_dir
    whole = load_model(model_dir, device="cpu")
    want = quantize_loaded(whole, mode, None)
    # the kernel is chosen by timing it (quantize.choose_kernel), which a loaded machine can flip between two
    # loads: the streamed load gets the one the whole load chose, so the two compute the same numbers
    got = load_quantized(model_dir, mode, kernel=want.kernel)
    report = got.quantization
    a, b = whole.model.state_dict(), got.model.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert sum(isinstance(m, QuantizedLinear) for m in got.model.modules()) == sum(want.layers.values()) > 0
    with torch.no_grad():
        assert torch.equal(whole.model(input_ids=PROMPT).logits, got.model(input_ids=PROMPT).logits)
    for field in ("effective", "kernel", "layers", "float_layers", "weight_bytes_before", "weight_bytes_after",
                  "probe_tokens", "head"):
        assert getattr(report, field) == getattr(want, field), field
    assert report.probe_kl > 0 and report.probe_kl == pytest.approx(want.probe_kl, rel=1e-3)
    assert got.base_model_sha256 == whole.base_model_sha256
    assert got.linear_kernels == whole.linear_kernels  # a hybrid's Gated DeltaNet route (None: attention)
    assert (got.linear_kernels is None) == (kind == "attention")


def test_streamed_load_holds_one_float_linear_weight_at_a_time(hybrid_dir, monkeypatch):
    """Every float projection weight read from the checkpoint is freed before the next is read: the
    bytes alive at once never exceed the largest one (the reference pass of the probe included)."""
    from kiln.runtime import quantize_load

    import json

    from safetensors import safe_open

    names = json.loads((hybrid_dir / "config.json").read_text())
    assert names["layer_types"]  # a hybrid: DeltaNet projections stream too
    with safe_open(str(next(hybrid_dir.glob("*.safetensors"))), "pt") as f:
        proj = {k: f.get_slice(k).get_shape() for k in f.keys() if k.endswith("proj.weight") or "in_proj" in k}
    largest = max(4 * s[0] * s[1] for s in proj.values())
    live, peak, reads = [0], [0], [0]
    get = quantize_load._Checkpoint.get

    def counted(self, key):
        t = get(self, key)
        if key in proj:
            nbytes = t.numel() * t.element_size()
            live[0] += nbytes
            reads[0] += 1
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, lambda: live.__setitem__(0, live[0] - nbytes))
        return t

    monkeypatch.setattr(quantize_load._Checkpoint, "get", counted)
    load_quantized(hybrid_dir, "int8", kernel="c")
    assert reads[0] >= 2 * len(proj)  # quantized once, read again for the probe's float reference
    assert 0 < peak[0] <= largest


def test_kl_is_nonnegative_in_float64_on_a_large_vocabulary():
    """Nearly equal distributions over 248,320 tokens: float64 gives the small positive KL a second-order
    estimate predicts (float32 log-probabilities made it rounding noise, negative at times)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 248_320, generator=g, dtype=torch.float64) * 3
    delta = torch.randn(6, 248_320, generator=g, dtype=torch.float64) * 1e-4
    p, q = torch.log_softmax(logits, -1), torch.log_softmax(logits + delta, -1)
    kl, tokens = mean_kl([p], [q])
    probs = p.exp()
    centered = delta - (probs * delta).sum(-1, keepdim=True)
    estimate = float((0.5 * (probs * centered ** 2).sum(-1)).mean())
    assert tokens == 6 and kl > 0 and kl == pytest.approx(estimate, rel=0.05)


def test_an_int8_copied_head_gets_no_packed_float_copy(builtin_model_dir):
    """The lean forward packs float Linear weights for oneDNN; an LM head that infers through its int8
    copy is not packed (that would be a third copy: float, int8 and packed float)."""
    from kiln.runtime.lean_forward import LeanForward

    loaded = load_quantized(builtin_model_dir, "int8", kernel="c")
    head = loaded.model.lm_head
    assert quantized_head(head) is not None
    lean = LeanForward(loaded.model, pack=True)
    assert head.weight.data_ptr() not in lean._packed


def test_quantize_with_the_vllm_engine_is_refused_before_anything_loads(tmp_path):
    """A typed ConfigError at settings load; ``kiln serve`` exits 2 on it before it looks at the model
    (a model path that does not exist is never reported)."""
    with pytest.raises(ConfigError, match="model.quantize"):
        load_settings(environ={"KILN_MODEL_QUANTIZE": "int8", "KILN_SERVING_ENGINE": "vllm"})
    assert load_settings(environ={"KILN_MODEL_QUANTIZE": "int8"}).settings.model.quantize == "int8"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")} | {"KILN_HOME": str(tmp_path / "home")}
    done = subprocess.run([str(Path(sys.executable).with_name("kiln")), "serve", "--model", str(tmp_path / "absent"),
                           "--quantize", "int4", "--engine", "vllm"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "model.quantize" in done.stderr and "absent" not in done.stderr


@pytest.mark.slow
def test_big_hybrid_bench_path_end_to_end(tmp_path):
    """bench/big_hybrid.py on its scaled-down shape: shards written layer by layer, ``kiln serve
    --quantize`` int8 and int4 ready, chatting, an SFT job succeeded over the quantized base, and the
    figures read back (probe KL, quantized bytes below the float ones, peak RSS)."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "big_hybrid.py"), "--shape", "small", "--work",
                           str(tmp_path), "--sft-steps", "2", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["int8", "int4"]
    for r in rows:
        assert r["sft"]["state"] == "succeeded" and r["sft"]["step"] == 2
        assert 0 < r["probe_kl"] < 0.2 and r["weight_bytes"] < r["float_bytes"]
        assert r["tok_s_c1"] > 0 and r["tok_s_c4"] > 0 and r["peak_rss"] >= r["rss_ready"] > 0
        assert r["layers"] == {r["mode"]: 31} and r["head"] == "int8"


def _multimodal_checkpoint(out: Path, builtin_model_dir: Path, dtype: torch.dtype) -> Path:
    """The published multimodal Qwen3.5 layout (``model.language_model.*``, a vision tower), every tensor
    stored as ``dtype``, plus an ``mtp.*`` tensor the causal LM does not have."""
    from safetensors.torch import load_file, save_file

    from tests.hybrid_models import build_tiny_hybrid

    build_tiny_hybrid(out, builtin_model_dir, multimodal=True)
    (shard,) = sorted(out.glob("*.safetensors"))
    tensors = {k: v.to(dtype).contiguous() for k, v in load_file(shard).items()}
    assert any(k.startswith("model.language_model.") for k in tensors)
    assert any(k.startswith("model.visual.") for k in tensors)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128, dtype=dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_multimodal_checkpoint_streams_like_the_whole_load(stored, mode, builtin_model_dir, tmp_path, monkeypatch):
    """``model.language_model.*`` maps onto the causal LM, the vision tower and MTP tensors are never
    read, bf16 on disk becomes the model dtype: no fallback to ``load_model``, and the same packed
    weights and logits as that fallback gives."""
    from kiln.runtime import loader, quantize_load

    model_dir = _multimodal_checkpoint(tmp_path / "mm", builtin_model_dir, stored)
    whole = load_model(model_dir, device="cpu")
    want = quantize_loaded(whole, mode, None)

    def no_fallback(*a, **k):
        raise AssertionError("load_quantized fell back to load_model")

    read: list[str] = []
    get = quantize_load._Checkpoint.get

    def spy(self, key):
        read.append(key)
        return get(self, key)

    monkeypatch.setattr(loader, "load_model", no_fallback)
    monkeypatch.setattr(quantize_load._Checkpoint, "get", spy)
    got = load_quantized(model_dir, mode, kernel=want.kernel)  # the same kernel (chosen by timing: see above)
    assert got.quantization.kernel == want.kernel
    assert read and not [k for k in read if k.startswith(("model.visual.", "mtp.", "model.language_model."))]
    a, b = whole.model.state_dict(), got.model.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert next(got.model.get_input_embeddings().parameters()).dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(whole.model(input_ids=PROMPT).logits, got.model(input_ids=PROMPT).logits)
    assert got.quantization.layers == want.layers and got.quantization.kernel == want.kernel
    assert got.quantization.probe_kl == pytest.approx(want.probe_kl, rel=1e-3)


def test_model_name_maps_the_language_model_prefix_only():
    from kiln.runtime.quantize_load import model_name

    assert model_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert model_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert model_name("lm_head.weight") == "lm_head.weight"
    assert model_name("model.visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert model_name("mtp.fc.weight") == "mtp.fc.weight"
    assert model_name("model.layers.0.input_layernorm.weight") == "model.layers.0.input_layernorm.weight"
