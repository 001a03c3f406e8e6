"""Fused RMSNorm (with and without the residual add) and rotary embedding, triton. The torch
references are `rms_norm.py` and `rotary.py`; tests/kernels/test_triton_kernels.py compares
them under the triton interpreter.

- `rms_norm` / `add_rms_norm`: grid (cdiv(rows, BLOCK_R),); a program normalises BLOCK_R rows
  of the last dim at once (BLOCK_R grows as the row shrinks, so per-head q/k norms over
  head_dim do not launch one tiny program per row). Rows are addressed through two leading
  strides, so a [T, H, D] view of a fused qkv projection is read in place. Float32 statistics;
  the rounding steps follow the reference (normalised value cast to the input dtype, then times
  the weight), and the residual variant writes the rounded sum as the new residual.
- `apply_rotary`: grid (T,); one program rotates every q head and every k head of one token
  ([H, D/2] tiles for each half, HF rotate-half layout). cos/sin rows are either given per token
  ([T, D], the reference contract) or gathered in the kernel from the [max_pos, D] tables by
  `positions` (`apply_rotary_by_position`). Llama-3 and linear scaling live in the tables. The
  arithmetic is float32 with one rounding at the end (the reference rounds each product when
  inputs are 16-bit, so 16-bit results may differ from it by an ulp). `qk_norm_rotary` also
  RMS-normalises each head first (q/k norm), saving two launches a layer: on an H200 a triton
  launch costs 45-68 us of host time in an eager step (docs/cuda-graphs.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, inner, stride0, stride1) addressing row i at (i // inner) * s0 + (i % inner) * s1
    with a contiguous last dim, copying only when that is impossible."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 0, 0
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1])
    return x, 1, x.stride(0), 0


@triton.jit
def _rms_norm_kernel(
    X,
    RES,
    W,
    OUT,
    RES_OUT,
    num_rows,
    x_inner,
    stride_x0,
    stride_x1,
    res_inner,
    stride_r0,
    stride_r1,
    eps,
    N: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x_off = (rows64 // x_inner) * stride_x0 + (rows64 % x_inner) * stride_x1
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r_off = (rows64 // res_inner) * stride_r0 + (rows64 % res_inner) * stride_r1
        res = tl.load(RES + r_off[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + rows64[:, None] * N + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=1) / N
    rstd = tl.rsqrt(var + eps)
    normed = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = normed * w[None, :]
    tl.store(OUT + rows64[:, None] * N + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {list(weight.shape)}")
    shape = x.shape
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = _empty(shape, torch.promote_types(weight.dtype, sum_dtype), x.device)
    res_out = None if residual is None else _empty(shape, sum_dtype, x.device)
    num_rows = x.numel() // n if n else 0
    if num_rows == 0:
        return out, res_out
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    xv, x_inner, sx0, sx1 = _rows_view(x)
    if residual is not None:
        rv, r_inner, sr0, sr1 = _rows_view(residual.expand(shape))
    else:
        rv, r_inner, sr0, sr1 = xv, 1, 0, 0
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(64, 4096 // block_n))
    tile = block_r * block_n
    num_warps = 4 if tile <= 4096 else (8 if tile <= 16384 else 16)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        xv,
        rv,
        weight,
        out,
        res_out if res_out is not None else out,
        num_rows,
        x_inner,
        sx0,
        sx1,
        r_inner,
        sr0,
        sr1,
        float(eps),
        N=n,
        HAS_RES=residual is not None,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; same contract and rounding as the reference."""
    return _launch_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) from one pass; inputs are not modified."""
    out, summed = _launch_norm(x, residual, weight, eps)
    assert summed is not None
    return out, summed


# -- rotary --------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    X,
    XO,
    W,
    eps,
    t,
    stride_xt,
    stride_xh,
    cos1,
    cos2,
    sin1,
    sin2,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_HALF)
    c_mask = c < HALF
    mask = (h < NUM_HEADS)[:, None] & c_mask[None, :]
    base = X + t * stride_xt + h[:, None] * stride_xh + c[None, :]
    raw1 = tl.load(base, mask=mask, other=0.0)
    raw2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1 = raw1.to(tl.float32)
    x2 = raw2.to(tl.float32)
    if HAS_NORM:
        # Each head's RMSNorm first (Qwen3's q/k norm), with rms_norm's rounding steps: the
        # normalised value in the input dtype, times the weight, rounded to the output dtype.
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(W + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        out_ty = XO.dtype.element_ty
        x1 = ((x1 * rstd).to(raw1.dtype).to(tl.float32) * w1).to(out_ty).to(tl.float32)
        x2 = ((x2 * rstd).to(raw2.dtype).to(tl.float32) * w2).to(out_ty).to(tl.float32)
    out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    obase = XO + t * (NUM_HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + c[None, :]
    tl.store(obase, out1.to(XO.dtype.element_ty), mask=mask)
    tl.store(obase + HALF, out2.to(XO.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    K,
    COS,
    SIN,
    POS,
    QO,
    KO,
    QW,
    KW,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_POS:
        row = tl.load(POS + t).to(tl.int64)
    else:
        row = t
    c = tl.arange(0, BLOCK_HALF)
    c_mask = c < HALF
    cos_row = COS + row * stride_cos + c
    sin_row = SIN + row * stride_sin + c
    cos1 = tl.load(cos_row, mask=c_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF, mask=c_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=c_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF, mask=c_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        Q,
        QO,
        QW,
        eps,
        t,
        stride_qt,
        stride_qh,
        cos1,
        cos2,
        sin1,
        sin2,
        NUM_Q_HEADS,
        HALF,
        HAS_NORM,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        K,
        KO,
        KW,
        eps,
        t,
        stride_kt,
        stride_kh,
        cos1,
        cos2,
        sin1,
        sin2,
        NUM_K_HEADS,
        HALF,
        HAS_NORM,
        BLOCK_HK,
        BLOCK_HALF,
    )


def _launch_rotary(q, k, cos, sin, positions, norm=None):
    """norm: (q_weight, k_weight, eps) to RMS-normalise each head first, or None."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError("q must be [T, Hq, D] and k [T, Hk, D]")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    q_w, k_w, eps = norm if norm is not None else (q, k, 0.0)
    if norm is not None:
        if q_w.shape != (head_dim,) or k_w.shape != (head_dim,):
            raise ValueError(f"q/k norm weights must be [{head_dim}]")
        if q_w.dtype != q.dtype or k_w.dtype != k.dtype:
            raise ValueError("q/k norm weights must have q's and k's dtype")
        q_w, k_w = q_w.contiguous(), k_w.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = _empty(q.shape, q.dtype, q.device)
    k_out = _empty(k.shape, k.dtype, k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        positions if positions is not None else cos,
        q_out,
        k_out,
        q_w,
        k_w,
        float(eps),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        HAS_POS=positions is not None,
        HAS_NORM=norm is not None,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D]; cos/sin [T, D], gathered by position. New q, k tensors."""
    return _launch_rotary(q, k, cos, sin, None)


def apply_rotary_by_position(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As apply_rotary with cos = cos_table[positions], gathered inside the kernel (the float32
    tables are read directly; no per-step gather or cast)."""
    return _launch_rotary(q, k, cos_table, sin_table, positions)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary(rms_norm(q, q_weight), rms_norm(k, k_weight), cos, sin) in one launch
    instead of three (weights in q's dtype). The head's sum of squares is taken in halves, so a
    result may differ from the three-launch chain by an ulp."""
    return _launch_rotary(q, k, cos, sin, None, (q_weight, k_weight, eps))
