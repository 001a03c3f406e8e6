"""Paged attention, torch reference: the CPU path and the oracle for the triton kernels.

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]. A request's
tokens live in the blocks of its block table; token at position p sits in block
`table[p // block_size]`, offset `p % block_size`.

Every attention function takes two optional per-layer settings:
- `window`: sliding-window attention, a query at position p sees keys in (p - window, p];
- `softcap`: Gemma 2's score soft-capping, scores become tanh(scores / softcap) * softcap
  before the softmax (SDPA cannot do that, so those calls take an explicit softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hk, D] into flat slots (block_id * block_size + offset)."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_blocks * block_size, Hk, D] contiguous K or V."""
    batch, max_blocks = block_tables.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    return cache[block_tables].view(batch, max_blocks * block_size, num_kv_heads, head_dim)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """[B, Hq, n, D] x [B, Hk, L, D] attention with a boolean mask (True: visible)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per request. query [B, Hq, D]; block_tables [B, max_blocks] (padded with
    any valid block id); context_lens [B] include the query token. Returns [B, Hq, D]."""
    keys = gather_kv(key_cache, block_tables).transpose(1, 2)  # [B, Hk, L, D]
    values = gather_kv(value_cache, block_tables).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = positions[None, :] < context_lens[:, None]
    if window is not None:
        mask &= positions[None, :] >= context_lens[:, None] - window
    out = _attend(query.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap)
    return out.squeeze(2)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One request's chunk of n query tokens at positions [context_len - n, context_len), attending
    causally to everything before it through the paged cache (cached prefix and earlier chunks).
    query [n, Hq, D]; block_table [num_blocks] covering context_len. Returns [n, Hq, D]."""
    num_queries = query.shape[0]
    keys = gather_kv(key_cache, block_table[None])[0, :context_len].transpose(0, 1)
    values = gather_kv(value_cache, block_table[None])[0, :context_len].transpose(0, 1)
    q_pos = torch.arange(context_len - num_queries, context_len, device=query.device)
    k_pos = torch.arange(context_len, device=query.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window is not None:
        mask &= k_pos > q_pos[:, None] - window
    # A batch dim: 3-D inputs with enable_gqa take the slow math path on CPU.
    out = _attend(query.transpose(0, 1)[None], keys[None], values[None], mask, scale, softcap)
    return out[0].transpose(0, 1)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill with no cached prefix: plain causal attention over the chunk's own K/V."""
    mask = None
    num = query.shape[0]
    if window is not None and window < num:
        pos = torch.arange(num, device=query.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    out = _attend(
        query.transpose(0, 1)[None],  # 4-D: 3-D inputs with enable_gqa take the math path on CPU
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        mask,
        scale,
        softcap,
        is_causal=mask is None,
    )
    return out[0].transpose(0, 1)
