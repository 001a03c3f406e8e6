"""silu(gate) * up in one pass over the fused gate_up projection, triton (reference:
`activation.py`). Torch runs it as two elementwise kernels and an intermediate: five passes
over [T, inter] against three here, and one launch a layer instead of two, where an eager triton
or torch launch costs tens of microseconds of host time (docs/cuda-graphs.md).

Grid (T, cdiv(inter, BLOCK)). The rounding steps follow the reference: silu in float32 rounded to
the input dtype, then the product in float32 rounded once. Triton's exp may differ from CUDA's
expf by an ulp in float32, so a 16-bit result can, rarely, differ by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _silu_mul_kernel(X, OUT, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g_raw = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = g_raw.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(g_raw.dtype).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * inter] -> silu(gate) * up [..., inter]."""
    inter = gate_up.shape[-1] // 2
    out = _empty((*gate_up.shape[:-1], inter), gate_up.dtype, gate_up.device)
    rows = gate_up.numel() // max(1, gate_up.shape[-1])
    if rows == 0 or inter == 0:
        return out
    x = gate_up.reshape(rows, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    grid = (rows, triton.cdiv(inter, _BLOCK))
    _silu_mul_kernel[grid](x, out, inter, x.stride(0), inter, BLOCK=_BLOCK, num_warps=4)
    return out
