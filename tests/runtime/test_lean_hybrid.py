"""The lean hybrid forward (kiln.runtime.lean_hybrid) and the Gated DeltaNet pieces under it
(kiln.runtime.gated_deltanet) against transformers' own Qwen3.5 forward on a tiny random hybrid:
logits within float tolerance for packed variable-length prompts, decode steps and prompts split
over cycles; greedy continuations equal to ``generate``; LoRA rows (the DeltaNet projections
included) equal to PEFT's forward; the C decode step and the chunked prefill against their torch
references."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.runtime import gated_deltanet as gdn
from kiln.runtime import lean_forward, paged_attention
from kiln.runtime.lean_hybrid import batch_of, lean_hybrid_for
from kiln.runtime.linear_state import LinearStatePool, linear_layers
from kiln.runtime.paged_kv import BlockPool, cache_shape
from tests.hybrid_models import hybrid_text_kwargs

BLOCK = 8
VOCAB = 96
ATOL = 2e-4  # logits of order 1: float rounding of a differently ordered but equal computation


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops: on a loaded machine more torch threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hybrid_text_kwargs(VOCAB, 1, 0))).eval()
    return m


class Harness:
    """A block pool, a state pool and rows driven cycle by cycle as the engine's batches do."""

    def __init__(self, model, *, kernel=True, gdn_kernel=True, pack=False):
        self.lean = lean_hybrid_for(model, pack=pack, kernel=paged_attention.load() if kernel else None,
                                    gdn_kernel=gdn.load() if gdn_kernel else None)
        assert self.lean is not None
        self.kv = BlockPool(cache_shape(model.config), 256, BLOCK, device="cpu", dtype=torch.float32,
                            prefix_cache=False)
        self.states = LinearStatePool(linear_layers(model), 16, device="cpu", dtype=torch.float32)

    def row(self, prompt, key="__base__"):
        return SimpleNamespace(tokens=list(prompt), prefilled=0, pos=0, blocks=[], generated=[], adapter_key=key,
                               state_slot=self.states.allocate())

    def cycle(self, decoding, chunks, snap_every=0, order=None):
        """One packed forward; ``order`` (a permutation of decoding + chunk rows) reorders the rows'
        spans in the packed sequence (logits stay in batch_of's order); returns (logits, completing)
        and keeps the batch's snapshots in ``self.captured``."""
        for r in decoding:
            self._blocks(r, r.pos + 1)
        for r, c in chunks:
            self._blocks(r, r.prefilled + c)
        batch, completing = batch_of(decoding, chunks, self.kv, "cpu", snap_every)
        if order is not None:
            batch = reordered(batch, order)
        with torch.inference_mode():
            logits = self.lean.forward_batch(batch, self.kv, self.states)
        if order is not None:  # back to batch_of's rows, then only those batch_of keeps a logit of
            everyone = [*decoding] + [r for r, _ in chunks]
            kept = [i for i, r in enumerate(everyone) if i < len(decoding) or any(r is c for c in completing)]
            logits = logits[torch.tensor(order).argsort()][kept]
        self.captured = {id(([*decoding] + [r for r, _ in chunks])[order[i] if order else i]): snaps
                         for i, snaps in batch.captured.items()}
        for r in decoding:
            r.pos += 1
        for r, c in chunks:
            r.prefilled += c
            r.pos = r.prefilled
        return logits, completing

    def _blocks(self, r, upto):
        while len(r.blocks) * BLOCK < upto:
            r.blocks.append(self.kv.allocate())

    def greedy(self, prompts, new_tokens, chunk):
        """Continuous batching: every cycle decodes the rows that finished their prompt and runs the
        next ``chunk`` prompt tokens of each other row, all in one packed forward."""
        rows = [self.row(p) for p in prompts]
        while any(len(r.generated) < new_tokens for r in rows):
            decoding = [r for r in rows if r.prefilled == len(r.tokens) and 0 < len(r.generated) < new_tokens]
            chunks = [(r, min(chunk, len(r.tokens) - r.prefilled)) for r in rows if r.prefilled < len(r.tokens)]
            logits, completing = self.cycle(decoding, chunks)
            for r, lg in zip(decoding + completing, logits):
                r.generated.append(int(lg.argmax()))
        return [r.generated for r in rows]


def reordered(batch, order):
    """``batch`` with its rows' spans packed in ``order``; every row keeps the logit of its last token
    (Harness.cycle picks those batch_of would keep)."""
    from kiln.runtime.lean_hybrid import HybridBatch

    ids, row_of, pos_of, spans, keep = [], [], [], [], []
    for new, r in enumerate(order):
        first, n = batch.spans[r]
        spans.append((len(ids), n))
        ids += batch.ids[first:first + n].tolist()
        pos_of += batch.pos_of[first:first + n].tolist()
        row_of += [new] * n
        keep.append(len(ids) - 1)
    return HybridBatch(ids=torch.tensor(ids), row_of=torch.tensor(row_of), pos_of=torch.tensor(pos_of),
                       spans=tuple(spans), slots=tuple(batch.slots[r] for r in order),
                       fresh=tuple(batch.fresh[r] for r in order), table=batch.table[torch.tensor(order)],
                       keep=torch.tensor(keep), keys=batch.keys, snap_every=batch.snap_every)


def prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_logits(model, ids, adapter=None):
    extra = {} if adapter is None else {"adapter_names": [adapter]}
    with torch.inference_mode():
        return model(torch.tensor([ids]), **extra).logits[0]


@pytest.mark.parametrize("kernels,pack", [(True, False), (False, False), (True, True)],
                         ids=["c-kernels", "torch-fallback", "packed-weights"])
def test_packed_prompts_then_decode_match_transformers(model, kernels, pack, monkeypatch):
    if pack:  # the tiny model's weights are under the packing threshold: pack them all
        if not torch.backends.mkldnn.is_available():
            pytest.skip("oneDNN is not available in this torch build")
        monkeypatch.setattr(lean_forward, "PACK_MIN_ELEMENTS", 0)
    h = Harness(model, kernel=kernels, gdn_kernel=kernels, pack=pack)
    assert h.lean.packed == pack
    batch = prompts((5, 70, 1, 19))
    rows = [h.row(p) for p in batch]
    logits, completing = h.cycle([], [(r, len(r.tokens)) for r in rows])  # one packed forward, fresh rows
    assert completing == rows
    for r, lg in zip(rows, logits):
        want = hf_logits(model, r.tokens)[-1]
        assert torch.allclose(lg, want, atol=ATOL), (lg - want).abs().max()
        r.generated.append(int(want.argmax()))
    for _ in range(3):  # decode steps: the fused GDN step and in-place attention over every row
        logits, _ = h.cycle(rows, [])
        for r, lg in zip(rows, logits):
            want = hf_logits(model, r.tokens + r.generated)[-1]
            assert torch.allclose(lg, want, atol=ATOL), (lg - want).abs().max()
            r.generated.append(int(want.argmax()))


def test_prompt_split_over_cycles_mixed_with_decode(model):
    h = Harness(model)
    long, short = prompts((45, 6), seed=5)
    a, b = h.row(long), h.row(short)
    h.cycle([], [(b, 6)])
    b.generated.append(0)
    for at in (0, 13, 29):  # 13 + 16 + 16 tokens of a, each cycle also decoding b
        n = min(16, 45 - at) if at else 13
        logits, completing = h.cycle([b], [(a, n)])
        want = hf_logits(model, b.tokens + b.generated)[-1]
        assert torch.allclose(logits[0], want, atol=ATOL)
        b.generated.append(int(want.argmax()))
    assert completing == [a]
    want = hf_logits(model, long)[-1]
    assert torch.allclose(logits[1], want, atol=ATOL), (logits[1] - want).abs().max()


def test_greedy_equals_generate(model):
    batch = prompts((3, 17, 40, 9, 33, 1, 24, 12), seed=11)
    got = Harness(model).greedy(batch, new_tokens=6, chunk=16)
    for p, out in zip(batch, got):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert out == ref[0, len(p):].tolist()


def test_lora_rows_match_peft(model):
    from peft import LoraConfig, get_peft_model

    import copy
    base = copy.deepcopy(model)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "out_proj", "gate_proj", "down_proj"]
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
                          adapter_name="one")
    peft.eval()
    lm = peft.base_model.model
    h = Harness(lm)
    assert h.lean.runs(["one", "__base__"], peft.peft_config)
    batch = prompts((9, 21), seed=2)
    rows = [h.row(batch[0], "one"), h.row(batch[1])]
    logits, _ = h.cycle([], [(r, len(r.tokens)) for r in rows])
    for r, lg in zip(rows, logits):
        want = hf_logits(peft, r.tokens, adapter=r.adapter_key)[-1]
        assert torch.allclose(lg, want, atol=ATOL), (lg - want).abs().max()
    assert not torch.allclose(logits[0], hf_logits(model, batch[0])[-1], atol=1e-2)  # the adapter does act


def test_decode_kernel_matches_reference():
    kernel = gdn.load()
    if kernel is None:
        pytest.skip("no C compiler here: the torch reference runs instead")
    for baseline in (False, True):
        k = gdn.GdnDecode(gdn.build(baseline_only=baseline))
        gdn._self_check(k)  # raises on a mismatch


def test_chunked_equals_recurrence_and_splits():
    g = torch.Generator().manual_seed(1)
    heads, dk, dv, t = 4, 8, 8, 150
    q = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=g), dim=-1)
    v = torch.randn(t, heads, dv, generator=g)
    decay, beta = -torch.rand(t, heads, generator=g), torch.rand(t, heads, generator=g)
    s0 = torch.randn(heads, dk, dv, generator=g)
    state = s0[None].clone()
    ref = torch.cat([gdn.recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], state)
                     for i in range(t)])
    o, s = gdn.chunked(q, k, v, decay, beta, s0)
    assert torch.allclose(o, ref, atol=1e-5) and torch.allclose(s, state[0], atol=1e-5)
    o1, s1 = gdn.chunked(q[:70], k[:70], v[:70], decay[:70], beta[:70], s0)
    o2, s2 = gdn.chunked(q[70:], k[70:], v[70:], decay[70:], beta[70:], s1)
    assert torch.allclose(torch.cat([o1, o2]), ref, atol=1e-5) and torch.allclose(s2, state[0], atol=1e-5)
    marks = {70: None, 100: None, t: None}  # copies inside one pass: a block ends at each mark
    o3, s3 = gdn.chunked(q, k, v, decay, beta, s0, marks=marks)
    assert torch.allclose(o3, ref, atol=1e-5) and torch.allclose(s3, state[0], atol=1e-5)
    assert torch.allclose(marks[70], s1, atol=1e-5) and torch.equal(marks[t], s3)
    _, s100 = gdn.chunked(q[:100], k[:100], v[:100], decay[:100], beta[:100], s0)
    assert torch.allclose(marks[100], s100, atol=1e-5) and not torch.allclose(marks[100], s1, atol=1e-3)
    zero = torch.zeros_like(s0)  # no start state (None: its terms are skipped) == an all-zero one
    for got, want in zip(gdn.chunked(q, k, v, decay, beta, None), gdn.chunked(q, k, v, decay, beta, zero)):
        assert torch.allclose(got, want, atol=1e-6)


def test_unsupported_models_keep_transformers():
    assert lean_hybrid_for(SimpleNamespace()) is None


def test_snapshots_restore_the_state_at_a_prefix(model):
    """The state captured at position 128 while a prompt ran in 40-token chunks, copied into another
    row's slot, continues that row to transformers' logits of the whole prompt (the prefix cache's
    restore, kiln.runtime.linear_state.LinearSnapshots)."""
    from kiln.runtime.linear_state import LinearSnapshots

    h = Harness(model)
    snaps = LinearSnapshots(h.states, BLOCK)
    (prompt,) = prompts((150,), seed=4)
    first = h.row(prompt)
    first.cache_key = "k"
    while first.prefilled < len(prompt):
        c = min(40, len(prompt) - first.prefilled)
        for _ in range(-(-(first.prefilled + c) // BLOCK) - len(first.blocks)):
            first.blocks.append(h.kv.allocate())
        batch, _ = batch_of([], [(first, c)], h.kv, "cpu", snaps.every)
        with torch.inference_mode():
            h.lean.forward_batch(batch, h.kv, h.states)
        snaps.put("k", prompt, batch.captured.get(0, {}))
        first.prefilled += c
    assert snaps.limit("k", prompt, len(prompt) - 1) == 128 and snaps.limit("other", prompt, 149) == 0
    second = h.row(prompt)
    second.blocks = list(first.blocks[:128 // BLOCK])  # the cached attention blocks of the prefix
    snaps.restore("k", prompt, 128, second.state_slot)
    second.prefilled = second.pos = 128
    logits, _ = h.cycle([], [(second, len(prompt) - 128)])
    want = hf_logits(model, prompt)[-1]
    assert torch.allclose(logits[0], want, atol=ATOL), (logits[0] - want).abs().max()
    second.prefilled = second.pos = 128  # the check has teeth: a wrong state moves the logits
    snaps.restore("k", prompt, 128, second.state_slot)
    for i in range(len(h.states.recurrent)):
        h.states.recurrent[i][second.state_slot].zero_()
    logits, _ = h.cycle([], [(second, len(prompt) - 128)])
    assert not torch.allclose(logits[0], want, atol=ATOL)


@pytest.mark.parametrize("interleaved", [False, True], ids=["packed-prompts", "prompts-between-decodes"])
def test_batched_prompt_path_equals_per_row(model, interleaved):
    """The prompt chunks of a cycle run their per-token parts once, packed together, and the delta
    rule per row with the prefix-cache copies taken inside its block loop: the same logits, conv
    windows, recurrent states and snapshots (positions and contents) as the reference path, which runs
    each chunk alone and splits it into separate passes at every snapshot position."""
    every = 16
    lengths = (150, 33, 5, 1, 64)
    runs = {}
    for batched in (True, False):
        h = Harness(model)
        h.lean.batched_prompts = batched
        rows = [h.row(p) for p in prompts(lengths, seed=9)]
        a, b, c, d, e = rows
        out, snaps = [], []
        # cycle 1: every row's first chunk (a's ends off the snapshot grid); 2 and 3: a continues from
        # position 40 (snapshots at 48, 64, 80, ...) beside the others' decode steps
        plan = [([], [(a, 40), (b, 33), (c, 5), (d, 1), (e, 20)]),
                ([b, c, d], [(a, 50), (e, 44)]),
                ([b, c, d, e], [(a, 60)])]
        for decoding, chunks in plan:
            n = len(decoding) + len(chunks)
            order = None
            if interleaved and decoding:  # prompt spans between decode spans: the non-contiguous gather
                order = [n - 1] + list(range(n - 1))
            if interleaved and not decoding:
                order = list(range(n))[::-1]
            logits, completing = h.cycle(decoding, chunks, snap_every=every, order=order)
            out.append(logits)
            snaps.append({rows.index(next(r for r in rows if id(r) == key)): v for key, v in h.captured.items()})
            for r in decoding + completing:
                r.generated.append(int(logits[(decoding + completing).index(r)].argmax()))
        slots = [r.state_slot for r in rows]
        states = [(conv[slots].clone(), rec[slots].clone()) for conv, rec in zip(h.states.conv, h.states.recurrent)]
        runs[batched] = out, snaps, states
    (bo, bs, bst), (ro, rs, rst) = runs[True], runs[False]
    for x, y in zip(bo, ro):
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()
    for (cx, sx), (cy, sy) in zip(bst, rst):
        assert torch.allclose(cx, cy, atol=1e-5) and torch.allclose(sx, sy, atol=1e-5)
    assert [{r: sorted(v) for r, v in s.items()} for s in bs] == [{r: sorted(v) for r, v in s.items()} for s in rs]
    assert [sorted(s.get(0, ())) for s in bs] == [[16, 32], [48, 64, 80], [96, 112, 128, 144]]  # row a's
    assert sorted(bs[0][1]) == [16, 32] and sorted(bs[1][4]) == [32, 48, 64]  # b (33 tokens), e's 2nd chunk
    for s_b, s_r in zip(bs, rs):
        for r in s_b:
            for pos in s_b[r]:
                for (cx, sx), (cy, sy) in zip(s_b[r][pos], s_r[r][pos]):
                    assert torch.allclose(cx, cy, atol=1e-5) and torch.allclose(sx, sy, atol=1e-5)
    want = hf_logits(model, prompts(lengths, seed=9)[0])[-1]
    assert torch.allclose(bo[2][-1], want, atol=ATOL)  # and both are transformers' forward
