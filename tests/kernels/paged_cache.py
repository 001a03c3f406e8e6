"""Random paged KV caches for the attention kernel tests."""

from __future__ import annotations

import torch


def random_paged_cache(num_seqs, hk, d, block_size, lens, seed=0):
    """Key and value caches [blocks, block_size, hk, d] and a block table per sequence covering
    its context length, its blocks scattered through the pool (not contiguous, not in order)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = num_seqs * max_blocks + 3
    kc = torch.randn(num_blocks, block_size, hk, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, hk, d, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks]
    return kc, vc, tables.view(num_seqs, max_blocks)
