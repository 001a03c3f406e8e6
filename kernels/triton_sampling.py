"""The exponential race fused with its noise, triton: token = argmax_i p_i / E_i for each row.

E_i is the counter-based Exp(1) noise of services/worker/sampling_noise.py (splitmix64 of the
row's mixed key plus (i + 1) golden-ratio steps, the top 23 bits as an odd 24-bit fraction u,
E = -log u), computed in registers instead of materialised: the torch twin builds a [rows,
vocab] int64 tensor through a dozen full passes, which on an H200 cost ~8 ms a step at 256 rows
of Qwen3's 151,936-token vocabulary (docs/cuda-graphs.md). Here the probs are
read once. The bits match the torch twin's; the log and the division may differ from torch's by
an ulp, so a near-tie can resolve differently (as it already may between CPU and CUDA).

Grid (rows,): one program walks its row in BLOCK-wide chunks, keeping each lane's best score
and its first index; the lanes are reduced at the end to the row's first maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _mix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _race_kernel(P, KEYS, OUT, vocab, stride_p, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = _mix64(tl.load(KEYS + row).to(tl.uint64))
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -1.0, tl.float32)  # scores are >= 0: any real one replaces it
    best_i = tl.zeros((BLOCK,), tl.int32)
    row_p = P + row.to(tl.int64) * stride_p
    for start in range(0, vocab, BLOCK):
        idx = start + lanes
        valid = idx < vocab
        p = tl.load(row_p + idx, mask=valid, other=0.0).to(tl.float32)
        z = _mix64(base + (idx + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        odd = ((z >> 41) * 2 + 1).to(tl.float32)  # < 2^24: exact
        score = p / -tl.log(odd * 5.9604644775390625e-08)  # 2^-24
        take = valid & (score > best)  # strict: a lane keeps its first maximum
        best = tl.where(take, score, best)
        best_i = tl.where(take, idx, best_i)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_i, vocab), axis=0)
    tl.store(OUT + row, first.to(tl.int64))


def race_sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[rows] int64 winners of the race over `probs` [rows, vocab] (unnormalised, >= 0) with
    the noise of int64 `keys` [rows]."""
    rows, vocab = probs.shape
    out = _empty((rows,), torch.int64, probs.device)
    if rows == 0:
        return out
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    _race_kernel[(rows,)](
        probs, keys.contiguous(), out, vocab, probs.stride(0), BLOCK=_BLOCK, num_warps=8
    )
    return out
