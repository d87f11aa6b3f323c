"""SparseKDLoss: the coarse-tail KL of the contract, dense equivalence at S = V."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kiln.distill.probability import coarse_tail_forward_kl  # noqa: E402
from kiln.training.losses.kd import SparseKDLoss, coarse_tail_kl  # noqa: E402


def _teacher(n: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 3, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_vocabulary_sparse_kl_equals_dense_kl_value_and_gradient(seed):
    n, v = 6, 11
    t_lp = _teacher(n, v, seed)
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(n, v, generator=g)
    # S = V, in an arbitrary per-row order, no tail.
    ids = torch.stack([torch.randperm(v, generator=g) for _ in range(n)])
    sel_lp = t_lp.gather(-1, ids).float()
    mask = torch.ones(n, v, dtype=torch.bool)
    tail = torch.zeros(n)
    target = torch.zeros(n, dtype=torch.long)

    a = logits.clone().requires_grad_(True)
    loss, _ = SparseKDLoss(ce_weight=0.0, kd_weight=1.0)(a, ids, sel_lp, mask, tail, target)
    loss.backward()

    b = logits.clone().requires_grad_(True)
    dense = torch.nn.functional.kl_div(
        torch.log_softmax(b, -1), t_lp.float(), log_target=True, reduction="none"
    ).sum(-1).mean()
    dense.backward()
    assert abs(loss.item() - dense.item()) < 1e-6
    assert torch.max(torch.abs(a.grad - b.grad)).item() < 1e-6
    assert torch.isfinite(a.grad).all()


def test_coarse_tail_matches_the_contract_reference():
    n, v, k = 5, 9, 3
    t_lp = _teacher(n, v, 7)
    g = torch.Generator().manual_seed(8)
    s_lp = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64), -1)
    ids = torch.topk(t_lp, k, -1).indices
    sel = t_lp.gather(-1, ids)
    tail = 1 - sel.exp().sum(-1)
    got = coarse_tail_kl(s_lp, ids, sel, torch.ones_like(ids, dtype=torch.bool), tail)
    for r in range(n):
        q_sel = s_lp[r, ids[r]]
        ref = coarse_tail_forward_kl(sel[r].tolist(), tail[r].item(), q_sel.tolist(), 1 - q_sel.exp().sum().item())
        assert math.isclose(got[r].item(), ref, abs_tol=1e-9)


def test_padded_slots_that_point_at_a_selected_id_are_ignored():
    v = 6
    s_lp = torch.log_softmax(torch.randn(1, v, dtype=torch.float64), -1)
    t = torch.log_softmax(torch.randn(1, v, dtype=torch.float64), -1)
    ids = torch.tensor([[2, 4, 2]])  # last slot is padding pointing at ID 2
    mask = torch.tensor([[True, True, False]])
    sel = t.gather(-1, ids)
    tail = 1 - sel[:, :2].exp().sum(-1)
    padded = coarse_tail_kl(s_lp, ids, sel, mask, tail)
    clean = coarse_tail_kl(s_lp, ids[:, :2], sel[:, :2], mask[:, :2], tail)
    assert torch.allclose(padded, clean, atol=1e-12)


def test_ce_part_and_shapes():
    n, v = 4, 7
    logits = torch.randn(n, v, requires_grad=True)
    target = torch.tensor([1, 2, -100, 3])
    ids = torch.zeros(n, 1, dtype=torch.long)
    loss, parts = SparseKDLoss(ce_weight=1.0, kd_weight=0.0)(
        logits, ids, torch.zeros(n, 1), torch.zeros(n, 1, dtype=torch.bool), torch.ones(n), target
    )
    ref = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)
    assert torch.allclose(loss, ref) and parts["kd"].item() == 0.0


def _sparse_teacher(t_lp: torch.Tensor, k: int, g: torch.Generator):
    """A captured row per teacher distribution: its top-``k`` IDs plus one forced random ID, their
    log-probabilities, the mask of real slots and the tail mass outside them."""
    n, v = t_lp.shape
    ids = torch.cat([torch.topk(t_lp, k, -1).indices, torch.randint(0, v, (n, 1), generator=g)], -1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    for r in range(n):  # a forced ID already in the top-k is a masked duplicate slot
        if ids[r, k] in ids[r, :k]:
            mask[r, k] = False
    sel = t_lp.gather(-1, ids).float()
    tail = (1 - torch.where(mask, sel.double().exp(), 0.0).sum(-1)).float()
    return ids, sel, mask, tail


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("ce_weight,kd_weight", [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.5, 2.0)])
def test_fused_backward_equals_autograd_reference(temperature, ce_weight, kd_weight):
    n, v, k = 7, 13, 3
    g = torch.Generator().manual_seed(3)
    ids, sel, mask, tail = _sparse_teacher(_teacher(n, v, 5), k, g)
    target = torch.randint(0, v, (n,), generator=g)
    target[2] = -100
    logits = torch.randn(n, v, generator=g)
    out = []
    for fused in (True, False):
        x = logits.clone().requires_grad_(True)
        loss, parts = SparseKDLoss(ce_weight, kd_weight, temperature, fused=fused)(x, ids, sel, mask, tail, target)
        loss.backward()
        out.append((loss.item(), parts["kd"].item(), x.grad))
    assert abs(out[0][0] - out[1][0]) < 1e-5 and abs(out[0][1] - out[1][1]) < 1e-5
    assert torch.max(torch.abs(out[0][2] - out[1][2])).item() < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("ce_weight,kd_weight", [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0)])
def test_linear_sparse_kd_from_hidden_states_equals_the_loss_on_full_logits(temperature, ce_weight, kd_weight):
    """Chunked head (3 rows of logits at a time): same loss, d/dh and d/dW as SparseKDLoss on h @ W^T."""
    from kiln.training.losses.kd import linear_sparse_kd

    n, h_dim, v, k = 8, 5, 17, 3
    g = torch.Generator().manual_seed(11)
    ids, sel, mask, tail = _sparse_teacher(_teacher(n, v, 9), k, g)
    target = torch.randint(0, v, (n,), generator=g)
    target[1] = -100
    hidden, weight = torch.randn(n, h_dim, generator=g), torch.randn(v, h_dim, generator=g)
    out = []
    for chunked in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if chunked:
            loss, parts = linear_sparse_kd(h, w, ids, sel, mask, tail, target, ce_weight=ce_weight,
                                           kd_weight=kd_weight, temperature=temperature, chunk_rows=3)
        else:
            loss, parts = SparseKDLoss(ce_weight, kd_weight, temperature)(h @ w.t(), ids, sel, mask, tail, target)
        loss.backward()
        out.append((loss.item(), parts["ce"].item(), parts["kd"].item(), h.grad, w.grad))
    a, b = out
    assert abs(a[0] - b[0]) < 1e-5 and abs(a[1] - b[1]) < 1e-5 and abs(a[2] - b[2]) < 1e-5
    assert torch.max(torch.abs(a[3] - b[3])).item() < 1e-5 and torch.max(torch.abs(a[4] - b[4])).item() < 1e-5
