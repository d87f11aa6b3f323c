"""OPD losses against direct computations (float64 references, no fixed-CPU numbers)."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.training.losses.opd import (
    RenormalizedReverseKL,
    SampledTokenLoss,
    TailForwardKL,
    TailReverseKL,
    candidates,
    full_reverse_kl,
    teacher_token_logp,
)


def _rows(teacher_logp: torch.Tensor, k: int, sampled: list[int]) -> list[dict[int, float]]:
    """vLLM-style rows: top-k plus the sampled token."""
    rows = []
    for t, tok in zip(teacher_logp, sampled):
        top = torch.topk(t, k).indices.tolist()
        ids = set(top) | {tok}
        rows.append({i: float(t[i]) for i in ids})
    return rows


@pytest.fixture(scope="module")
def builtin_logits(builtin_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(builtin_model_dir)).eval()
    ids = torch.tensor([[3, 17, 42, 5, 99, 7, 11, 64, 23, 8]])
    with torch.no_grad():
        student = model(input_ids=ids).logits[0].double()
        # The teacher: the same model on another context, sharpened (a different but related distribution).
        teacher = torch.log_softmax(2.0 * model(input_ids=ids.flip(1)).logits[0].double(), -1)
    return student, teacher


def test_tail_with_k_equal_vocab_is_full_reverse_kl_on_builtin_model(builtin_logits):
    student, teacher = builtin_logits
    v = student.shape[-1]
    sampled = torch.argmax(student, -1).tolist()
    ids, lp, mask = candidates(_rows(teacher, v, sampled), sampled, v, include_sampled=True)
    tail = TailReverseKL()(student, ids, lp.double(), mask)
    full = full_reverse_kl(student, teacher)
    assert full.item() > 0.01
    assert math.isclose(tail.item(), full.item(), rel_tol=1e-6, abs_tol=1e-7)


def _direct_bucket_kl(student, teacher, rows, *, forward: bool) -> float:
    """Mean over rows of KL over S = the row's tokens plus one bucket for the rest, term by term (float64)."""
    q_all = torch.softmax(student, -1)
    want = []
    for t, row in enumerate(rows):
        s = sorted(row)  # S = teacher top-k plus the sampled token
        q, p = q_all[t, s], teacher[t, s].exp()
        a, b = (p, q) if forward else (q, p)
        a_out, b_out = 1 - float(a.sum()), 1 - float(b.sum())
        want.append(float((a * (a.log() - b.log())).sum()) + a_out * (math.log(a_out) - math.log(b_out)))
    return sum(want) / len(want)


@pytest.mark.parametrize("loss_cls", [TailReverseKL, TailForwardKL])
def test_bucketed_losses_match_direct_computation(builtin_logits, loss_cls):
    student, teacher = builtin_logits
    k = 5
    sampled = [int(torch.multinomial(torch.softmax(s, -1), 1, generator=torch.Generator().manual_seed(i)))
               for i, s in enumerate(student)]
    rows = _rows(teacher, k, sampled)
    ids, lp, mask = candidates(rows, sampled, k, include_sampled=True)
    got = loss_cls()(student, ids, lp.double(), mask).item()
    assert math.isclose(got, _direct_bucket_kl(student, teacher, rows, forward=loss_cls is TailForwardKL),
                        rel_tol=1e-5)
    assert got >= 0


def test_tail_is_zero_when_student_equals_teacher():
    logits = torch.randn(4, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    teacher = torch.log_softmax(logits, -1)
    sampled = [1, 2, 3, 4]
    ids, lp, mask = candidates(_rows(teacher, 3, sampled), sampled, 3, include_sampled=True)
    assert abs(TailReverseKL()(logits, ids, lp.double(), mask).item()) < 1e-6  # float32 inside the loss


def test_forward_with_k_equal_vocab_is_full_forward_kl_and_its_gradient_is_q_minus_p(builtin_logits):
    student, teacher = builtin_logits
    v = student.shape[-1]
    sampled = torch.argmax(student, -1).tolist()
    ids, lp, mask = candidates(_rows(teacher, v, sampled), sampled, v, include_sampled=True)
    z = student.clone().requires_grad_(True)
    got = TailForwardKL()(z, ids, lp.double(), mask)
    (grad,) = torch.autograd.grad(got, z)
    p = teacher.exp()
    full = (p * (teacher - torch.log_softmax(student, -1))).sum(-1).mean()
    assert full.item() > 0.01
    assert math.isclose(got.item(), full.item(), rel_tol=1e-5)
    # d/dz_v = (q_v - p_v) / N: it raises the teacher's token however little mass the student gives it
    assert torch.allclose(grad, (torch.softmax(student, -1) - p) / student.shape[0], atol=1e-6)


def test_sampled_token_is_importance_weighted_to_the_sampling_temperature():
    """Over every token, weighted by the sampling policy (the student at temperature T), the estimator's
    gradient is exactly the gradient of the per-token reverse KL(q || p) at temperature 1."""
    g = torch.Generator().manual_seed(3)
    v, temp = 7, 0.5
    z = torch.randn(v, dtype=torch.float64, generator=g, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(v, dtype=torch.float64, generator=g), -1)
    logq = torch.log_softmax(z, -1)
    sampler = torch.log_softmax(z.detach() / temp, -1)
    expected = sum(sampler[y].exp() * SampledTokenLoss()(logq[y:y + 1], teacher[y:y + 1], sampler[y:y + 1])
                   for y in range(v))
    (g_est,) = torch.autograd.grad(expected, z, retain_graph=True)
    (g_kl,) = torch.autograd.grad((logq.exp() * (logq - teacher)).sum(), z, retain_graph=True)
    assert torch.allclose(g_est, g_kl, atol=1e-12)
    # without the importance weight the same samples estimate another (wrong) gradient
    unweighted = sum(sampler[y].exp() * SampledTokenLoss()(logq[y:y + 1], teacher[y:y + 1]) for y in range(v))
    (g_bad,) = torch.autograd.grad(unweighted, z)
    assert not torch.allclose(g_bad, g_kl, atol=1e-3)


def test_renormalized_matches_direct_computation():
    g = torch.Generator().manual_seed(1)
    student = torch.randn(3, 40, dtype=torch.float64, generator=g)
    teacher = torch.log_softmax(torch.randn(3, 40, dtype=torch.float64, generator=g), -1)
    k = 4
    sampled = [0, 0, 0]
    ids, lp, mask = candidates(_rows(teacher, k, sampled), sampled, k, include_sampled=False)
    got = RenormalizedReverseKL()(student, ids, lp.double(), mask).item()
    want = 0.0
    for t in range(3):
        top = torch.topk(teacher[t], k).indices
        q = torch.softmax(student[t], -1)[top]
        p = teacher[t, top].exp()
        q, p = q / q.sum(), p / p.sum()
        want += float((q * (q.log() - p.log())).sum())
    assert math.isclose(got, want / 3, rel_tol=1e-6)


def test_sampled_token_loss_pushes_toward_teacher():
    logits = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    sampled = torch.tensor([0, 1])
    logq = torch.log_softmax(logits, -1).gather(-1, sampled[:, None])[:, 0]
    # The teacher likes token 0 at row 0 and dislikes token 1 at row 1.
    loss = SampledTokenLoss()(logq, torch.tensor([math.log(0.9), math.log(0.01)], dtype=torch.float64))
    loss.backward()
    assert logits.grad[0, 0] < 0  # gradient descent raises the liked token's logit
    assert logits.grad[1, 1] > 0  # and lowers the disliked one's


def test_outside_top_k_share():
    from kiln.training.losses.opd import outside_top_k

    rows = [{5: -0.1, 6: -2.0, 9: -5.0}, {5: -0.1, 6: -2.0}]  # row 0: token 9 is the sampled one, outside top-2
    assert outside_top_k(rows, [9, 6], 2) == 0.5
    assert outside_top_k(rows, [9, 6], 3) == 0.0
    assert outside_top_k([], [], 2) == 0.0


def test_missing_sampled_token_uses_tail_mass():
    rows = [{5: math.log(0.5), 6: math.log(0.3)}]
    assert math.isclose(float(teacher_token_logp(rows, [9])[0]), math.log(0.2), rel_tol=1e-6)
    assert math.isclose(float(teacher_token_logp(rows, [6])[0]), math.log(0.3), rel_tol=1e-6)


def test_chunked_candidate_loss_matches_full_logits_with_gradients():
    """The OPD head path (completion positions only, candidate columns only, a chunk at a time, gradient
    computed in forward) gives the full-logits loss and the same gradients on the hidden states."""
    from kiln.training.opd.head import candidate_loss_mean

    g = torch.Generator().manual_seed(0)
    n, hdim, v, k = 37, 16, 300, 6
    h = torch.randn(n, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, hdim, generator=g, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64), -1)
    sampled = torch.randint(0, v, (n,), generator=g).tolist()
    ids, lp, mask = candidates(_rows(teacher, k, sampled), sampled, k, include_sampled=True)
    lp = lp.double()
    for loss_cls in (TailForwardKL, TailReverseKL, RenormalizedReverseKL):
        logq_full = torch.log_softmax(h @ w.t(), -1).gather(-1, ids)  # float64, all V columns materialised
        full = loss_cls.from_logq(logq_full, lp, mask)
        (g_full,) = torch.autograd.grad(full, h)
        assert math.isclose(loss_cls()(h @ w.t(), ids, lp, mask).item(), full.item(), rel_tol=1e-5)
        # chunks of 5 rows: several chunks, the last one partial
        fused = candidate_loss_mean(h, w, ids, lambda lq, rows: loss_cls.from_logq(  # noqa: B023
            lq, lp[rows], mask[rows]) * lq.shape[0], chunk_elements=5 * v)
        (g_fused,) = torch.autograd.grad(fused, h)
        assert math.isclose(fused.item(), full.item(), rel_tol=1e-9)
        assert torch.allclose(g_fused, g_full, rtol=1e-7, atol=1e-10)


def test_engine_sampling_in_waves_is_seeded_per_row(builtin_model_dir):
    """Student sampling on the engine with the private adapter: more rows than half the engine's queue go
    in waves; every row's seed fixes its tokens (the same seeds give the same completions, whatever the
    wave size); after a weight change, a new revision never reuses prefix-cache blocks of the old weights."""
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.training.core.engine_sampling import sample_batch, sample_on_engine
    from kiln.training.core.lora import add_private_adapter, lora_config

    loaded = load_model(str(builtin_model_dir), device="cpu", dtype="float32")
    engine = Engine(loaded, EngineConfig(max_model_len=256, max_queued_rows=8, max_running_rows=4)).start()
    try:
        pm = engine.peft_model()
        with engine.ownership.exclusive():
            add_private_adapter(pm, "priv", lora_config(4, 8, ["q_proj", "v_proj"]), seed=0)
        prompts = [engine.encode_chat([{"role": "user", "content": w}]) for w in ("ant", "bee", "cat", "dog")]
        seeds = [[100 * i + j for j in range(3)] for i in range(4)]
        kw = dict(seeds=seeds, end_ids=[])
        first = sample_on_engine(engine, "priv", "r0", prompts, 3, 6, 1.0, 1.0, **kw)  # 12 rows, waves of 1 prompt
        assert len(first) == 12 and all(1 <= len(c) <= 6 for c in first)
        assert sample_on_engine(engine, "priv", "r0", prompts, 3, 6, 1.0, 1.0, **kw) == first
        # one row count and one token budget per prompt (OPD's teacher-path rows: longer prompts, fewer tokens);
        # a prompt with 0 rows gives none; the same seeds give the same rows, on the engine and through the
        # batched generate fallback
        mixed = sample_on_engine(engine, "priv", "r0", prompts, [2, 0, 1, 1], [3, 5, 2, 4], 1.0, 1.0, **kw)
        assert [len(c) for c in mixed] == [3, 3, 2, 4]
        assert sample_on_engine(engine, "priv", "r0", prompts, [2, 0, 1, 1], [3, 5, 2, 4], 1.0, 1.0, **kw) == mixed
        with engine.ownership.exclusive():
            pm.base_model.set_adapter("priv")
            gen = sample_batch(pm, prompts, [1, 2, 0, 0], [4, 2, 9, 9], 1.0, 1.0, seed=3, pad_id=0, end_ids=[],
                               device="cpu")
            assert [len(c) for c in gen] == [4, 2, 2]
            assert sample_batch(pm, prompts, 0, 4, 1.0, 1.0, seed=3, pad_id=0, end_ids=[], device="cpu") == []
        # a prompt of several KV blocks: revision r1 caches its blocks; after the weights change, revision r2
        # must not reuse them (greedy tokens equal a plain forward with the new weights)
        long = [engine.encode_chat([{"role": "user", "content": " ".join(["ant bee cat"] * 20)}])]
        assert len(long[0]) > 3 * engine.config.kv_block_size
        greedy = dict(seeds=seeds[:1], end_ids=[])
        sample_on_engine(engine, "priv", "r1", long, 1, 4, 0.0, 1.0, **greedy)
        with engine.ownership.exclusive(), torch.no_grad():  # "an optimizer step": the adapter now changes logits
            for name, p in pm.named_parameters():
                if ".priv." in name and "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        after = sample_on_engine(engine, "priv", "r2", long, 1, 4, 0.0, 1.0, **greedy)[0]
        with engine.ownership.exclusive(), torch.no_grad():
            pm.base_model.set_adapter("priv")
            seq = list(long[0])
            for _ in range(4):
                seq.append(int(pm(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert after == seq[len(long[0]):]
    finally:
        engine.stop()


def test_ce_on_the_teacher_path_reuses_its_rows_hidden_states_and_matches_full_logits(builtin_model_dir):
    """opd_loss with CE on a gold row that a completion starts with (the teacher path's CE on its own path row):
    the split-head path reuses that row's hidden states and gives the loss and gradients of the full-logits path,
    which runs the gold row separately; a gold row no completion starts with still runs through the trunk."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from kiln.training.core.lora import lora_config
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.opd.job import OPDData
    from kiln.training.opd.step import opd_loss

    torch.manual_seed(0)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(str(builtin_model_dir)),
                        lora_config(4, 8, ["q_proj", "v_proj"]))
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    prompt, other = (3, 17, 42, 5), (3, 9, 11)
    path, sample = [7, 8, 9, 10], [7, 12, 13]
    pairs = [(prompt, sample), (prompt, path + [21])]
    sampled = sample + path + [21]
    rows = [{t: -0.5, (t + 1) % 500: -1.5} for t in sampled]
    data = OPDData((), {}, 1, 1.0, 1.0, 8, 2, "forward", 3.0, 1)
    grads = []
    for gold in ([(prompt, tuple(path))], [(prompt, tuple(path)), (other, (30, 31))]):
        for split in (split_causal_lm(pm), None):
            pm.zero_grad()
            loss = opd_loss(pm, split, data, pairs, rows, sampled, gold, pad_id=0, device="cpu")
            loss.backward()
            grads.append((loss.item(), [p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad]))
        (a, ga), (b, gb) = grads[-2:]
        assert math.isclose(a, b, rel_tol=1e-5)
        assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(ga, gb))
    assert grads[0][0] != grads[2][0]  # the second gold row counts


class _TinyLM(torch.nn.Module):
    """A 4-token autoregressive model whose logits at each position depend on the token and the position
    (float64), with the ``model(input_ids=, attention_mask=, use_cache=).logits`` call ``opd_loss`` makes."""

    def __init__(self, v: int = 4, d: int = 6, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(v, d, generator=g, dtype=torch.float64))
        self.pos = torch.nn.Parameter(torch.randn(8, d, generator=g, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.randn(d, v, generator=g, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        from types import SimpleNamespace

        h = torch.tanh(self.emb[input_ids] + self.pos[: input_ids.shape[1]])
        return SimpleNamespace(logits=h @ self.head)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_token_gradient_is_the_per_token_reverse_kl_gradient_over_whole_completions(temperature):
    """Through Kiln's own ``opd_loss`` (teacher rows, sampler log-probabilities, token mean): the sampled-token
    loss of every 3-token completion, weighted by the probability the student samples it at ``temperature``,
    has the gradient of ``tail`` with K = vocabulary (the exact per-token reverse KL at each visited
    position) weighted the same way, while one completion's estimate can point against it."""
    import itertools

    from kiln.training.opd.job import OPDData
    from kiln.training.opd.step import opd_loss

    v, length, prompt = 4, 3, [0]
    model = _TinyLM(v)
    g = torch.Generator().manual_seed(1)
    teacher_table = torch.log_softmax(3 * torch.randn(v, length, v, generator=g, dtype=torch.float64), -1)

    def data(loss: str) -> OPDData:
        return OPDData((), {}, 1, temperature, 1.0, length, v, loss, 0.0, 1)

    grads: dict[str, list[torch.Tensor]] = {"sampled_token": [], "tail": []}
    weights = []
    for comp in itertools.product(range(v), repeat=length):
        seq = prompt + list(comp)
        with torch.no_grad():  # the probability that the student samples this completion at the temperature
            logits = model(torch.tensor([seq])).logits[0, len(prompt) - 1: -1]
            weights.append(float(torch.log_softmax(logits / temperature, -1).gather(
                -1, torch.tensor(comp)[:, None]).sum().exp()))
        rows = [{t: float(teacher_table[seq[j + len(prompt) - 1], j, t]) for t in range(v)} for j in range(length)]
        for loss in grads:
            model.zero_grad()
            opd_loss(model, None, data(loss), [(prompt, list(comp))], rows, list(comp), [], pad_id=0,
                     device="cpu").backward()
            grads[loss].append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert math.isclose(sum(weights), 1.0, rel_tol=1e-9)
    w = torch.tensor(weights, dtype=torch.float64)[:, None]
    expected_sampled = (w * torch.stack(grads["sampled_token"])).sum(0)
    expected_tail = (w * torch.stack(grads["tail"])).sum(0)
    assert expected_tail.norm() > 0.05
    diff = float((expected_sampled - expected_tail).norm() / expected_tail.norm())
    assert diff < 1e-5, diff  # opd_loss works in float32
    # while a single completion's sampled-token gradient can point against it (the estimator's variance)
    cos = [float(x @ expected_tail / (x.norm() * expected_tail.norm())) for x in grads["sampled_token"]]
    assert min(cos) < 0
