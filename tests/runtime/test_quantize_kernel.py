"""Kiln's C int8/int4 weight-only matmul (kiln.runtime.quant_matmul): every path this CPU runs,
and the portable build alone, against the dequantized reference."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime import quant_matmul as qm
from kiln.runtime.paged_attention import build

REL_TOL = 2e-2  # the activations' int8 rounding per group


@pytest.fixture(scope="module")
def kernel():
    k = qm.load()
    if k is None:
        pytest.skip("no C compiler here (the kernel is optional: torch's kernels remain)")
    return k


def _operands(mode: str, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if mode == "int8":
        return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.02
    codes = torch.randint(0, 16, (n, k), generator=g)
    s = qm.snap_int4_scales(torch.rand(n, k // 32, generator=g) * 0.05 + 1e-4)  # integer multiples of a row scale
    scales = torch.stack([s, torch.randn(n, k // 32, generator=g) * 0.02], -1)
    return qm.pack_int4(codes), scales.contiguous()


def _paths(kernel) -> list[str]:
    return [name for name, level in qm.ISAS.items() if level <= qm.ISAS[kernel.isa]]


def test_int4_packing_round_trips():
    codes = torch.randint(0, 16, (6, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = qm.pack_int4(codes)
    assert packed.shape == (6, 32) and packed.dtype == torch.uint8
    assert torch.equal(qm.unpack_int4(packed), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 16]) << 4  # element j low, j + 16 high


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_every_path_equals_the_dequantized_reference(kernel, mode, rows):
    n, k = 37, 160  # an odd number of outputs: the kernels' single-column tail
    q, s = _operands(mode, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    want = qm.reference(x, q, s, mode) + bias
    outs = {isa: kernel.matmul(x, q, s, mode, bias=bias, isa=isa) for isa in _paths(kernel)}
    for isa, got in outs.items():
        assert (got - want).abs().max().item() < REL_TOL * want.abs().max().item(), isa
        # one set of integer block sums on every path: only the float accumulation order differs
        assert torch.allclose(got, outs["portable"], rtol=1e-5, atol=1e-4), isa


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_threads_split_outputs_without_changing_them(kernel, mode):
    n, k = 2050, 4096  # 256 rows x n x k above the kernel's threshold for OpenMP (2^31)
    q, s = _operands(mode, n, k, seed=4)
    x = torch.randn(256, k, generator=torch.Generator().manual_seed(5))
    one = kernel.matmul(x, q, s, mode, threads=1)
    assert torch.equal(kernel.matmul(x, q, s, mode, threads=2), one)  # each output is computed whole by one thread
    assert (one - qm.reference(x, q, s, mode)).abs().max().item() < REL_TOL * one.abs().max().item()


def test_baseline_build_runs_the_portable_path(tmp_path, kernel):
    """Built with -DKILN_BASELINE_ONLY (what a CPU without AVX2 gets): portable code only, same results."""
    base = qm.QuantMatmul(build(tmp_path, baseline_only=True, source=qm.SOURCE, flags=qm.FLAGS, libs=qm.LIBS))
    assert base.isa == "portable"
    qm.self_check(base)
    for mode in ("int8", "int4"):
        q, s = _operands(mode, 40, 96, seed=6)
        x = torch.randn(5, 96, generator=torch.Generator().manual_seed(7))
        assert torch.allclose(base.matmul(x, q, s, mode), kernel.matmul(x, q, s, mode, isa="portable"),
                              rtol=1e-6, atol=1e-6)
    if kernel.isa != "portable":
        with pytest.raises(ValueError, match="rejected"):  # a path this build lacks is refused, not run
            base.matmul(x, q, s, "int4", isa=kernel.isa)


def test_bad_arguments_are_refused(kernel):
    q, s = _operands("int8", 8, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.matmul(torch.randn(2, 48), q[:, :48].contiguous(), s, "int8")
    with pytest.raises(ValueError, match="must be"):
        kernel.matmul(torch.randn(2, 64), q, s, "int4")  # an int8 matrix given as int4
    with pytest.raises(ValueError, match="float32"):
        kernel.matmul(torch.randn(2, 64, dtype=torch.bfloat16), q, s, "int8")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("group", [32, 96, 128, 0])
def test_activation_groups_on_every_path(kernel, mode, group):
    """The activation scale per group (a partial last group at k = 160; 96: groups of an odd number of
    blocks, int4's 512-bit path takes their last block alone; the whole row at 0): every path equals
    the reference and the portable path."""
    n, k = 37, 160
    q, s = _operands(mode, n, k, seed=8)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(9))
    want = qm.reference(x, q, s, mode)
    outs = {isa: kernel.matmul(x, q, s, mode, isa=isa, group=group) for isa in _paths(kernel)}
    for isa, got in outs.items():
        assert (got - want).abs().max().item() < REL_TOL * want.abs().max().item(), isa
        assert torch.allclose(got, outs["portable"], rtol=1e-5, atol=1e-4), isa


def test_an_activation_group_not_a_multiple_of_32_is_refused(kernel):
    q, s = _operands("int8", 8, 64)
    with pytest.raises(ValueError, match="rejected"):
        kernel.matmul(torch.randn(2, 64), q, s, "int8", group=48)


def test_int4_subscales_recover_snapped_scales():
    """The quantizer's block scales are integer multiples of a row scale; the kernel's integers give them back."""
    raw = torch.rand(7, 12, generator=torch.Generator().manual_seed(10)) * 0.1 + 1e-5
    snapped = qm.snap_int4_scales(raw)
    assert (snapped >= raw * (1 - 1e-5)).all()  # rounded up: a block's range stays covered
    assert ((snapped - raw) <= raw.amax(-1, keepdim=True) / qm.SUB_MAX * (1 + 1e-5)).all()
    sub, row = qm.int4_subscales(torch.stack([snapped, torch.zeros_like(snapped)], -1))
    assert sub.dtype == torch.int16 and int(sub.min()) >= 1 and int(sub.max()) == qm.SUB_MAX
    assert torch.allclose(sub.float() * row[:, None], snapped, rtol=1e-5)


@pytest.mark.parametrize("k", [32, 64, 1024, 8192])
def test_int4_large_codes_do_not_overflow(kernel, k):
    """Every code 15 or 0, activations at +-max and sub-scales 255: the int16 pair sums and int32 group
    sums stay exact on every path (whole-row group; at k = 8,192 the kernel caps int4 groups at 2,048,
    where a whole row's unsigned sums would pass 2^31)."""
    n = 6
    codes = torch.tensor([15, 0, 15, 15, 0, 0])[:, None].expand(n, k).contiguous()
    s = torch.full((n, k // 32), 0.01)
    scales = torch.stack([s, torch.zeros_like(s)], -1).contiguous()
    x = torch.where(torch.arange(k) % 3 == 0, 1.0, -1.0).repeat(3, 1)
    q = qm.pack_int4(codes)
    want = qm.reference(x, q, scales, "int4")
    for isa in _paths(kernel):
        got = kernel.matmul(x, q, scales, "int4", isa=isa, group=0)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), isa
