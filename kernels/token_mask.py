"""A grammar's token bitmask applied to logits rows, in place (docs/structured-outputs.md).

bitmask is llguidance's layout: int32 words, bit j of word w allows token 32w + j, one row of
words per logits row. The native CPU kernel (csrc/token_mask.cpp) tests whole words; the torch
reference below unpacks the bits, and is what other devices run.
"""

from __future__ import annotations

import math

import torch

from stoker.kernels import cpu_ops

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool; ids past the words are not allowed."""
    shifts = _SHIFTS.to(bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool)
    return torch.cat([bits, pad.to(bits.device)], dim=1)


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, fill: float = -math.inf
) -> None:
    allowed = allowed_tokens(bitmask[rows.to(bitmask.device)], logits.shape[1])
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), fill)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, fill: float = -math.inf
) -> None:
    """logits [R, V], bitmask [R, W] int32 (on the logits' device), rows int64: the rows to
    mask; a disallowed token's logit becomes `fill`."""
    if cpu_ops.apply_token_bitmask(logits, bitmask, rows, fill):
        return
    apply_token_bitmask_reference(logits, bitmask, rows, fill)


def allowed_at(bitmask: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[R, N] bool: whether row r's mask allows token_ids[n] (ids past the words: no)."""
    words = token_ids >> 5
    inside = words < bitmask.shape[1]
    picked = bitmask[:, words.clamp(max=bitmask.shape[1] - 1)]
    bits = (picked >> (token_ids & 31).to(torch.int32)) & 1
    return bits.bool() & inside
