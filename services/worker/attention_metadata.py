"""Per-step attention inputs, built once per step by the model runner and shared by all layers."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PrefillSpan:
    """One request's chunk of query tokens: rows [start, end) of the step's flat token batch."""

    start: int
    end: int
    context_len: int  # tokens attended to, including this chunk
    block_table: torch.Tensor | None  # None when the chunk starts at position 0 (no paged read)


@dataclasses.dataclass
class AttentionMetadata:
    """The step's tokens are laid out decode-first: rows [0, num_decode) are single query
    positions, each attending to its own context through its own block table row (a decoding
    request, or one position of a short chunk such as a speculative verify); prefill chunks
    follow, described by `prefills`."""

    slot_mapping: torch.Tensor  # [T] flat KV slot for each token
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]
    decode_context_lens: torch.Tensor | None  # [num_decode]
    prefills: list[PrefillSpan]
    # The prefill spans again as one batch, for the native CPU kernel (kernels/cpu_ops.py) that
    # attends all of them in one call: span s is rows [num_decode + bounds[s], num_decode +
    # bounds[s + 1]) with context lens[s] through tables[s]. None off the CPU.
    prefill_tables: torch.Tensor | None = None  # [S, max_blocks]
    prefill_bounds: torch.Tensor | None = None  # [S + 1]
    prefill_lens: torch.Tensor | None = None  # [S]
    # Set only in the metadata of a model's last layer, where just the sampled rows need an
    # output: the rows kept (every decode row, then each prompt chunk's sampled tail). The layer
    # still stores every row's K/V; attention, the output projection and the MLP then run on
    # the kept rows alone, and prefill_bounds count each chunk's kept rows.
    out_rows: torch.Tensor | None = None  # [R]
