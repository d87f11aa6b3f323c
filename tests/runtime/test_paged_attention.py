"""The in-place paged attention kernel (kiln.runtime.paged_attention): built with the machine's
C compiler, checked against a plain-torch reference and against SDPA over gathered blocks,
wired into the engine's decode and packed steps, and its fallbacks."""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kiln.runtime import paged_attention
from kiln.runtime.adapter_slots import BASE_KEY
from kiln.runtime.batches import Batches
from kiln.runtime.paged_kv import BlockPool, CacheShape, cache_shape


@pytest.fixture(scope="module")
def kernel():
    k = paged_attention.load()
    if k is None:
        pytest.skip("no C compiler here: the engine uses gather + SDPA (tested elsewhere)")
    return k


def _pool(blocks: int, block_size: int, kv_heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    values = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    return keys, values


@pytest.fixture(scope="module")
def baseline_kernel(kernel, tmp_path_factory):
    """The same source built without ISA clones: the code a CPU without AVX2/AVX-512 runs."""
    return paged_attention.PagedAttention(paged_attention.build(tmp_path_factory.mktemp("baseline"),
                                                                baseline_only=True))


@pytest.mark.parametrize("variant", ["dispatched", "baseline"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         [(8, 8, 64, 16), (4, 2, 32, 4), (16, 8, 128, 16), (6, 1, 16, 3), (32, 2, 8, 5)])
def test_kernel_matches_the_reference_for_decode_and_chunk_tokens(kernel, baseline_kernel, variant, heads, kv_heads,
                                                                  dim, block_size):
    """Decode tokens of several rows, a prompt chunk (a run of one row's tokens: the tiled path),
    positions 0 and across block boundaries, blocks scattered over the pool; the clone this CPU
    picks and the baseline build."""
    kernel = kernel if variant == "dispatched" else baseline_kernel
    width = -(-70 // block_size)
    keys, values = _pool(3 * width + 8, block_size, kv_heads, dim)
    gen = torch.Generator().manual_seed(1)
    table = (torch.randperm(3 * width + 7, generator=gen)[: 3 * width] + 1).view(3, width).contiguous()
    row_of = torch.tensor([0, 1, 2] + [1] * 37 + [0, 2])
    pos_of = torch.tensor([0, 69, 17] + list(range(20, 57)) + [block_size, block_size - 1])
    q = torch.randn(len(row_of), heads, dim, generator=gen)
    scale = 1 / math.sqrt(dim)
    got = kernel.attend(q, keys, values, table, row_of, pos_of, scale)
    want = paged_attention.reference(q, keys, values, table, row_of, pos_of, scale)
    assert got.shape == (len(row_of), heads * dim)
    assert (got - want).abs().max().item() < 2e-5


def test_kernel_matches_sdpa_over_gathered_blocks_with_strided_queries(kernel):
    """The engine's decode shape: queries are a strided view of the fused q|k projection."""
    keys, values = _pool(40, 16, 2, 64, seed=3)
    table = torch.tensor([[5, 9, 2, 0], [7, 1, 3, 4], [11, 0, 0, 0]])
    pos = torch.tensor([40, 63, 0])
    qk = torch.randn(3, 4 + 2, 1, 64)
    q = qk[:, :4]  # [rows, heads, 1, dim], not contiguous
    got = kernel.attend(q[:, :, 0], keys, values, table, torch.arange(3), pos, 0.125)
    k = keys[table.reshape(-1)].view(3, 64, 2, 64).transpose(1, 2).repeat_interleave(2, 1)
    v = values[table.reshape(-1)].view(3, 64, 2, 64).transpose(1, 2).repeat_interleave(2, 1)
    mask = (torch.arange(64)[None, :] <= pos[:, None])[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125).reshape(3, -1)
    assert (got - want).abs().max().item() < 1e-5


def test_kernel_stores_the_tokens_own_keys_and_values_before_attending(kernel):
    """A prompt chunk and a decode token with their new K/V passed as strided views (as the lean
    forward's fused projection gives them): the pool ends up as index_put would leave it, and
    the chunk's tokens see each other's keys."""
    keys, values = _pool(12, 4, 2, 16, seed=7)
    table = torch.tensor([[3, 7, 1], [5, 2, 0]])
    row_of = torch.tensor([0, 0, 0, 0, 0, 1])
    pos_of = torch.tensor([2, 3, 4, 5, 6, 5])  # row 0 writes 2..6 (across a block boundary), row 1 writes 5
    gen = torch.Generator().manual_seed(8)
    kv = torch.randn(6, 2, 3, 16, generator=gen)  # [tokens, k|v|spare, kv_heads..]: strided views below
    new_k, new_v = kv[:, 0, :2], kv[:, 1, :2]
    q = torch.randn(6, 4, 16, generator=gen)
    want_k, want_v = keys.clone(), values.clone()
    blocks = table[row_of, pos_of // 4]
    want_k[blocks, pos_of % 4] = new_k
    want_v[blocks, pos_of % 4] = new_v
    want = paged_attention.reference(q, want_k, want_v, table, row_of, pos_of, 0.25)
    got = kernel.attend(q, keys, values, table, row_of, pos_of, 0.25, new_keys=new_k, new_values=new_v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    assert (got - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="new keys"):
        kernel.attend(q, keys, values, table, row_of, pos_of, 0.25, new_keys=new_k[:, :1], new_values=new_v)


def test_add_rms_norm_is_the_residual_add_and_transformers_rmsnorm(kernel):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(3, 5, 48, generator=gen)
    delta = torch.randn(3, 5, 48, generator=gen)
    want_h = h + delta
    with torch.no_grad():
        want = norm(want_h)
    got = kernel.add_rms_norm(h, delta, norm.weight.detach(), norm.variance_epsilon)
    assert torch.equal(h, want_h)  # the residual add happened in place, bitwise
    assert (got - want).abs().max().item() < 1e-5
    assert (kernel.add_rms_norm(h, None, norm.weight.detach(), 1e-6) - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="contiguous"):
        kernel.add_rms_norm(h.transpose(0, 1), None, norm.weight.detach(), 1e-6)


def test_kernel_rejects_what_it_cannot_read(kernel):
    keys, values = _pool(4, 4, 2, 8)
    table, rows, pos = torch.tensor([[1, 2]]), torch.tensor([0]), torch.tensor([3])
    with pytest.raises(ValueError, match="float32"):
        kernel.attend(torch.randn(1, 4, 8, dtype=torch.float64), keys, values, table, rows, pos, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        kernel.attend(torch.randn(1, 8, 4).transpose(1, 2), keys, values, table, rows, pos, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernel.attend(torch.randn(1, 4, 8), keys, values, table.int(), rows, pos, 1.0)
    with pytest.raises(ValueError, match="rejected"):  # 3 query heads over 2 KV heads
        kernel.attend(torch.randn(1, 3, 8), keys, values, table, rows, pos, 1.0)


def test_build_is_cached_by_content_and_a_broken_compiler_is_a_clear_error(kernel, tmp_path, monkeypatch):
    first = paged_attention.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert paged_attention.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary build folder left behind
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo broken-cc 1.0; exit 0; }\n"
                      "echo 'error: no such intrinsic' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(paged_attention.KernelUnavailable, match="no such intrinsic"):
        paged_attention.build(tmp_path / "other")
    monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
    with pytest.raises(paged_attention.KernelUnavailable, match="missing-cc"):
        paged_attention.build(tmp_path / "other")


def test_load_falls_back_to_none_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(paged_attention, "_loaded", [])
    monkeypatch.setenv("KILN_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-compiler"))
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.paged_attention"):
        assert paged_attention.load() is None
        assert paged_attention.load() is None  # once per process: no second attempt, no second warning
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "gathers blocks for SDPA" in messages[0] and "no-compiler" in messages[0]


def test_kernel_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_KERNEL_DIR", str(tmp_path / "k"))
    assert paged_attention.kernel_dir() == tmp_path / "k"
    monkeypatch.delenv("KILN_KERNEL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paged_attention.kernel_dir() == tmp_path / "xdg" / "kiln" / "kernels"


# -- in the engine's steps ----------------------------------------------------------------------

def _model(kind: str):
    """A small random decoder: Qwen3 (q/k norms, GQA), Qwen2 (q/k/v biases), Llama (all attention biases)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True,
                  attn_implementation="sdpa")
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=64, **common)).eval()
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)).eval()
    return tf.LlamaForCausalLM(tf.LlamaConfig(attention_bias=True, **common)).eval()


@pytest.fixture(scope="module")
def gqa_model():
    return _model("qwen3")


def _rows(pool: BlockPool, specs: list[tuple[int, int]]):
    """Rows holding ``pos`` positions whose blocks cover ``pos + extra``."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for pos, extra in specs:
        blocks = [pool.allocate() for _ in range(pool.blocks_for(pos + extra))]
        tokens = torch.randint(0, 512, (pos + extra,), generator=gen).tolist()
        rows.append(SimpleNamespace(pos=pos, prefilled=pos, blocks=blocks, generated=[tokens[pos - 1]],
                                    tokens=tokens, adapter_key=BASE_KEY))
    return rows


def _reset(rows, specs):
    for r, (pos, _) in zip(rows, specs):
        r.pos = r.prefilled = pos


@pytest.mark.parametrize(("kind", "packed_weights"),
                         [("qwen3", False), ("qwen3", True), ("qwen2", True), ("llama", False)])
def test_decode_and_packed_steps_in_place_match_gather_and_sdpa(kernel, kind, packed_weights):
    """The kernel applies q/k norms (Qwen3) and RoPE itself and stores the new K/V: the logits of
    a decode step and of a packed step (decode rows plus a prompt chunk) match the gather path."""
    gqa_model = _model(kind)
    pool = BlockPool(cache_shape(gqa_model.config), 64, 4, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        for t in pool.keys + pool.values:
            t.normal_()
    both = {on: Batches(pool, None, "cpu", 0, model=gqa_model, packed_weights=packed_weights,
                        paged_attention=kernel if on else None) for on in (False, True)}
    assert both[True].paged_attention is kernel and both[False].paged_attention is None
    decode_specs = [(3, 1), (9, 1), (17, 1)]
    rows = _rows(pool, decode_specs)
    chunk_specs = [(5, 11)]  # a row with 5 cached positions and an 11-token prompt chunk to go
    chunk_rows = _rows(pool, chunk_specs)
    saved = [t.clone() for t in pool.keys + pool.values]
    out = {}
    with torch.inference_mode():
        for on, batches in both.items():
            for t, s in zip(pool.keys + pool.values, saved):
                t.copy_(s)
            _reset(rows, decode_specs)
            _reset(chunk_rows, chunk_specs)
            dec = batches.decode(rows)
            assert [r.pos for r in rows] == [3, 9, 17]  # the builders read rows; the cycle's update advances them
            for r in rows:
                r.pos += 1
            assert batches.packable(rows, [(chunk_rows[0], 11)])
            d2, done, completing = batches.packed(rows, [(chunk_rows[0], 11)])
            out[on] = (dec, d2, done, completing)
    tol = 1e-4 if packed_weights else 1e-5
    for a, b in zip(out[False][:3], out[True][:3]):
        assert a.shape == b.shape and (a - b).abs().max().item() < tol
    assert out[True][3] == out[False][3] == chunk_rows


def test_rope_rows_from_the_table_equal_the_rotary_module_bitwise(gqa_model):
    from kiln.runtime.lean_forward import lean_forward_for

    lean = lean_forward_for(gqa_model)
    inner = gqa_model.model
    h = torch.zeros(1, 1, 256)
    with torch.inference_mode():
        for positions in (torch.tensor([0, 5, 63]), torch.tensor([200, 7, 64, 129])):  # the second grows the table
            cos, sin = lean._rope_rows(inner, h, positions)
            want_cos, want_sin = inner.rotary_emb(h, positions[None])
            assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert lean._rope_table[0].shape[0] == 256


def test_prompt_only_and_adapter_rows_keep_sdpa(kernel, gqa_model):
    """A packed step of one prompt alone keeps SDPA's GEMMs; rows with an adapter the lean forward cannot run
    (here: no PEFT model) keep transformers' forward."""
    pool = BlockPool(CacheShape(2, 2, 64, 4), 32, 4, device="cpu", dtype=torch.float32)
    batches = Batches(pool, None, "cpu", 0, model=gqa_model, paged_attention=kernel)
    rows = _rows(pool, [(0, 8)])
    seen = []
    real_step = pool.step
    pool.step = lambda *a, **kw: seen.append(kw.get("in_place")) or real_step(*a, **kw)
    with torch.inference_mode():
        batches.packed([], [(rows[0], 8)])
    assert seen == [None]
    rows[0].adapter_key = "tenant-a"
    assert batches._in_place(rows) is None


def test_engine_uses_the_kernel_and_greedy_outputs_equal_the_gather_path(kernel, builtin_model_dir):
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.runtime.sampling import SamplingParams

    loaded = load_model(builtin_model_dir)
    questions = ["What is the capital of France?", "Count: 1 2 3", "Hi", "Tell me about the river and the sea.",
                 "Name three colours.", "2 + 2 ="]
    params = SamplingParams(max_tokens=20, temperature=0)
    outputs = {}
    for on in (True, False):
        engine = Engine(loaded, EngineConfig(max_running_rows=8, max_model_len=256, paged_attention=on)).start()
        try:
            assert (engine._scheduler.batches.paged_attention is kernel) is on
            prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in questions]
            with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: decode and packed mixed steps
                done = list(pool.map(lambda p: engine.generate(p, params, timeout=120)[0], prompts))
            outputs[on] = [c.token_ids for c in done]
        finally:
            engine.stop()
    assert all(outputs[True]) and outputs[True] == outputs[False]


def test_settings_switch_the_kernel_off():
    from kiln.config import Settings
    from kiln.runtime.engine_config import EngineConfig

    assert EngineConfig.from_settings(Settings()).paged_attention is True
    off = Settings.model_validate({"batching": {"paged_attention": False}})
    assert EngineConfig.from_settings(off).paged_attention is False


def test_no_temporary_files_left_in_the_default_kernel_dir(kernel):
    leftovers = [p for p in os.listdir(kernel.path.parent) if p.startswith(".build-")]
    assert leftovers == []
