"""The native bfloat16 pair kernel (AVX512-BF16) that bfloat16 linear layers run on: against
float64 matmuls to one bfloat16 rounding, its batch and thread invariance, and which layout
`pack_weight` picks for bfloat16 weights."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import cpu_ops
from stoker.services.worker.models.layers import linear, pack_weight, pack_weights

_module = cpu_ops.load()
pytestmark = pytest.mark.skipif(
    _module is None or not _module.bf16_pairs_supported(),
    reason="the pair kernel needs the native build on an AVX512-BF16 CPU",
)


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    return weight, torch.randn(n, generator=gen).bfloat16()


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact result from the same bfloat16 inputs, in float64."""
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


# Rows around the 4-row tile; panel counts around the 4-panel tile and the split over threads
# (1, 3, 5, 36 panels); K from one pair up.
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 64])
@pytest.mark.parametrize(("n", "k"), [(16, 2), (48, 64), (80, 578), (576, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pair_linear_matches_a_float64_matmul_to_one_rounding(rows, n, k, with_bias):
    weight, bias = _weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    b = bias if with_bias else None
    got = cpu_ops.bf16_pairs_linear(x, cpu_ops.pack_bf16_pairs(weight), b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    want = _reference(x, weight, b)
    # Products are exact and sums float32 (2^-24 a term); the output's one rounding is at most
    # 2^-8 relative (bfloat16's 8-bit significand).
    sums = x.double().abs() @ weight.double().abs().T
    err = (got.double() - want).abs()
    assert bool((err <= 2.0**-8 * want.abs() + k * 2.0**-23 * sums + 1e-30).all())


def test_pair_linear_takes_strided_rows_and_leading_dims():
    weight, bias = _weights(32, 40)
    packed = cpu_ops.pack_bf16_pairs(weight)
    wide = torch.randn(9, 100).bfloat16()
    x = wide[:, 10:50]  # rows 100 values apart, as a view into a fused projection is
    assert torch.equal(
        cpu_ops.bf16_pairs_linear(x, packed, bias),
        cpu_ops.bf16_pairs_linear(x.contiguous(), packed, bias),
    )
    x3 = torch.randn(2, 3, 40).bfloat16()
    got = cpu_ops.bf16_pairs_linear(x3, packed)
    assert got.shape == (2, 3, 32)
    assert torch.equal(got, cpu_ops.bf16_pairs_linear(x3.reshape(6, 40), packed).view(2, 3, 32))
    assert cpu_ops.bf16_pairs_linear(torch.empty(0, 40).bfloat16(), packed).shape == (0, 32)


def test_a_rows_result_depends_on_neither_its_batch_nor_the_thread_count():
    """Each output is one ordered chain over K, whichever tile it lands in: a row computes the
    same bits alone, in a partial tile, and with the panels split over one thread or two."""
    weight, bias = _weights(576, 96)
    packed = cpu_ops.pack_bf16_pairs(weight)
    x = torch.randn(23, 96).bfloat16()
    full = cpu_ops.bf16_pairs_linear(x, packed, bias)
    for row in (0, 3, 4, 7, 21, 22):
        assert torch.equal(cpu_ops.bf16_pairs_linear(x[row : row + 1], packed, bias)[0], full[row])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(cpu_ops.bf16_pairs_linear(x, packed, bias), full)
    finally:
        torch.set_num_threads(threads)


def test_packing_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_ops.pack_bf16_pairs(torch.randn(20, 8).bfloat16())
    with pytest.raises(RuntimeError, match="K even"):
        cpu_ops.pack_bf16_pairs(torch.randn(16, 7).bfloat16())
    packed = cpu_ops.pack_bf16_pairs(torch.randn(16, 8).bfloat16())
    with pytest.raises(RuntimeError, match="features"):
        cpu_ops.bf16_pairs_linear(torch.randn(2, 6).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_ops.bf16_pairs_linear(torch.randn(2, 8).bfloat16(), packed, torch.randn(8))


def test_pack_weight_lays_bfloat16_weights_out_in_pairs_unless_onednn_is_forced(monkeypatch):
    weight, bias = _weights(48, 24)
    x = torch.randn(5, 24).bfloat16()
    want = _reference(x, weight, bias)
    monkeypatch.setenv("STOKER_CPU_GEMM", "auto")
    pairs = pack_weight(weight)
    assert pairs.dim() == 4 and not pairs.is_mkldnn
    torch.testing.assert_close(linear(x, pairs, bias).double(), want, rtol=2**-8, atol=1e-3)
    assert pack_weight(torch.randn(20, 24).bfloat16()).is_mkldnn  # no whole panels: oneDNN
    monkeypatch.setenv("STOKER_CPU_GEMM", "onednn")
    packed = pack_weight(weight)
    assert packed.is_mkldnn
    torch.testing.assert_close(linear(x, packed, bias).double(), want, rtol=2**-8, atol=1e-3)


def test_pack_weights_puts_pairs_in_the_arena_with_the_same_results(monkeypatch):
    monkeypatch.setenv("STOKER_CPU_GEMM", "auto")
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, 24, generator=gen).bfloat16() for n in (48, 20, 32)]
    packed = pack_weights(weights)
    assert packed[0].dim() == packed[2].dim() == 4 and packed[1].is_mkldnn
    assert packed[2].data_ptr() - packed[0].data_ptr() == 48 * 24 * 2  # one arena, 64-aligned
    x = torch.randn(5, 24, generator=gen).bfloat16()
    for w, p in zip(weights, packed, strict=True):
        assert torch.equal(linear(x, p), linear(x, pack_weight(w)))
