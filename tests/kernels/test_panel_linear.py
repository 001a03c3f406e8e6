"""The native panel linear kernel (float32 or bfloat16 weights, AVX2 or AVX-512) against float64
matmuls, its batch invariance, which layout `pack_weight` picks, and the huge-page arena
`pack_weights` fills."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import cpu_ops
from stoker.services.worker.cpu_tuning import HUGE_PAGE
from stoker.services.worker.models.layers import linear, pack_weight, pack_weights

_module = cpu_ops.load()
pytestmark = pytest.mark.skipif(
    _module is None or not _module.panel_linear_supported(),
    reason="the panel kernel needs the native build on an AVX2 + FMA CPU",
)


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)


# Rows around the register tiles (6 rows on AVX2, 12 on AVX-512) and the chunks (48, 96); K odd
# and even; an odd number of panels (16, 48 columns: AVX-512 pairs them).
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 11, 12, 13, 25, 47, 48, 49, 97, 100])
@pytest.mark.parametrize(("n", "k"), [(16, 3), (96, 64), (48, 577)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_matches_a_float64_matmul(rows, n, k, with_bias):
    weight, bias = _weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight), bias if with_bias else None)
    want = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 49, 100])
@pytest.mark.parametrize(("n", "k"), [(16, 3), (96, 64), (48, 577)])
def test_bfloat16_panels_sum_exact_products_in_float32_and_round_once(rows, n, k):
    """bfloat16 x and W: every product is exact in float32, so the result is the float32 sum
    rounded to bfloat16 once; against a float64 sum, rounding may differ only at near-ties."""
    weight, bias = (t.bfloat16() for t in _weights(n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight), bias)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)  # one rounding
    assert (got != exact.bfloat16()).float().mean() < 0.01


def test_bfloat16_rows_do_not_depend_on_their_batch():
    weight, bias = (t.bfloat16() for t in _weights(64, 200))
    panels = cpu_ops.pack_panels(weight)
    x = torch.randn(110, 200).bfloat16()
    full = cpu_ops.panel_linear(x, panels, bias)
    for row in (0, 5, 6, 47, 48, 109):
        assert torch.equal(cpu_ops.panel_linear(x[row : row + 1], panels, bias)[0], full[row])


def test_panel_linear_refuses_mixed_dtypes():
    panels = cpu_ops.pack_panels(torch.randn(16, 8).bfloat16())
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_ops.panel_linear(torch.randn(2, 8), panels)


def test_panel_linear_takes_strided_rows_and_leading_dims():
    weight, _ = _weights(32, 40)
    panels = cpu_ops.pack_panels(weight)
    wide = torch.randn(9, 100)
    x = wide[:, 10:50]  # rows 100 floats apart, as a view into a fused projection is
    torch.testing.assert_close(cpu_ops.panel_linear(x, panels), x @ weight.T, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 40)
    got = cpu_ops.panel_linear(x3, panels)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, x3 @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_its_batch():
    """Each output is one FMA chain over K in order, so a row computes bitwise the same alone,
    in a partial tile, or past a chunk of rows: decode and verify steps agree exactly."""
    weight, bias = _weights(64, 200)
    panels = cpu_ops.pack_panels(weight)
    x = torch.randn(110, 200)
    full = cpu_ops.panel_linear(x, panels, bias)
    for row in (0, 5, 6, 11, 12, 47, 48, 59, 96, 109):
        assert torch.equal(cpu_ops.panel_linear(x[row : row + 1], panels, bias)[0], full[row])
    assert torch.equal(cpu_ops.panel_linear(x[3:10], panels, bias), full[3:10])


def test_pack_panels_refuses_a_width_that_is_not_a_multiple_of_16():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_ops.pack_panels(torch.randn(20, 8))


def test_pack_weight_picks_the_layout_by_setting_and_shape(monkeypatch):
    weight, bias = _weights(48, 24)
    x = torch.randn(5, 24)
    want = x @ weight.T + bias
    monkeypatch.setenv("STOKER_CPU_GEMM", "panel")
    panels = pack_weight(weight)
    assert panels.dim() == 3 and not panels.is_mkldnn
    torch.testing.assert_close(linear(x, panels, bias), want, rtol=1e-5, atol=1e-5)
    odd = pack_weight(torch.randn(20, 24))  # 20 rows: no whole panels, so oneDNN's layout
    assert odd.is_mkldnn
    # bfloat16 takes the panels only where the AVX512-BF16 pair kernel is not built.
    assert (pack_weight(weight.bfloat16()).dim() == 3) == (not cpu_ops.use_bf16_pairs())
    monkeypatch.setenv("STOKER_CPU_GEMM", "onednn")
    packed = pack_weight(weight)
    assert packed.is_mkldnn
    torch.testing.assert_close(linear(x, packed, bias), want, rtol=1e-5, atol=1e-5)


def test_pack_weights_puts_panels_in_one_arena_with_the_same_results(monkeypatch):
    monkeypatch.setenv("STOKER_CPU_GEMM", "panel")
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(48, 24, generator=gen), torch.randn(20, 24, generator=gen)]
    weights.append(torch.randn(32, 7, generator=gen))  # 32 x 7 x 4 bytes: not a 64-byte multiple
    weights.append(torch.randn(16, 24, generator=gen))
    packed = pack_weights(weights)
    assert packed[1].is_mkldnn  # 20 rows: oneDNN's layout, outside the arena
    panels = [packed[0], packed[2], packed[3]]
    base = panels[0].data_ptr()
    assert base % HUGE_PAGE == 0  # the arena starts on a huge-page boundary
    for p in panels:
        assert p.dim() == 3 and p.data_ptr() % 64 == 0  # the kernel's aligned loads
    assert panels[2].data_ptr() - base == 48 * 24 * 4 + (-(-32 * 7 * 4 // 64) * 64)  # one arena
    x = torch.randn(5, 24, generator=gen)
    for w, p in zip(weights, packed, strict=True):
        xin = x[:, : w.shape[1]] if w.shape[1] == 24 else torch.randn(5, 7, generator=gen)
        assert torch.equal(linear(xin, p), linear(xin, pack_weight(w)))
