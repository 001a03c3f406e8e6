"""Flatten one step's chunks of tokens into model inputs and attention metadata.

Shared by the target model and the draft model. Short chunks go first, on the decode path (one
row per position); longer chunks follow as prefill spans. Each chunk says how many of its last
positions need logits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from common.model_config import ModelConfig
from kernels.dispatch import decode_reads_cache_in_place
from services.worker.attention_metadata import AttentionMetadata, PrefillSpan


@dataclasses.dataclass
class Chunk:
    token_ids: list[int]  # tokens to compute, at positions start, start + 1, ...
    start: int
    block_ids: list[int]  # the request's block table (covers start + len(token_ids))
    num_sampled: int  # logits wanted for this many trailing positions (0, 1, or k + 1 to verify)


@dataclasses.dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states to turn into logits
    sample_ranges: list[tuple[int, int]]  # per chunk, in the given order: its rows in the logits


# Chunks up to this many tokens (decodes, speculative verifies of k + 1 positions, short prompt
# chunks) run on the decode path with one row per position, each with its own context length:
# the paged decode kernels read the cache in place, where a prefill span gathers the context
# and builds a mask.
MAX_DECODE_CHUNK = 16


def max_decode_chunk(device: torch.device, dtype: torch.dtype, cfg: ModelConfig) -> int:
    """The longest chunk to lay out as decode rows for this model: MAX_DECODE_CHUNK where the
    decode attention reads the cache in place, else 1 (the reference gathers each row's whole
    context, so one row per position of a verify would gather it k + 1 times)."""
    in_place = decode_reads_cache_in_place(
        device, dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    )
    return MAX_DECODE_CHUNK if in_place else 1


def build_step_inputs(
    chunks: list[Chunk],
    block_size: int,
    device: torch.device,
    max_decode_chunk: int = MAX_DECODE_CHUNK,
) -> StepInputs:
    """max_decode_chunk: the longest chunk laid out as decode rows (see `max_decode_chunk`)."""
    bs = block_size
    short = [len(c.token_ids) <= max_decode_chunk for c in chunks]
    order = [i for i, c in enumerate(chunks) if short[i]]
    num_short = len(order)
    order += [i for i, c in enumerate(chunks) if not short[i]]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[tuple[list[int], int]] = []  # (block table, context length) per query row
    hidden_rows: dict[int, tuple[int, int]] = {}  # chunk index -> its rows in the flat batch
    spans: list[PrefillSpan] = []
    for rank, i in enumerate(order):
        chunk = chunks[i]
        start_row = len(input_ids)
        end_pos = chunk.start + len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        if rank < num_short:
            for pos in range(chunk.start, end_pos):
                positions.append(pos)
                slots.append(chunk.block_ids[pos // bs] * bs + pos % bs)
                decode_rows.append((chunk.block_ids, pos + 1))
        else:
            pos_arr = np.arange(chunk.start, end_pos)
            positions.extend(pos_arr.tolist())
            blocks = np.asarray(chunk.block_ids, dtype=np.int64)
            slots.extend((blocks[pos_arr // bs] * bs + pos_arr % bs).tolist())
            table = None
            if chunk.start > 0:
                table = torch.tensor(chunk.block_ids[: -(-end_pos // bs)], device=device)
            spans.append(PrefillSpan(start_row, len(input_ids), end_pos, table))
        hidden_rows[i] = (start_row, len(input_ids))

    num_decode = len(decode_rows)
    decode_tables = decode_lens = None
    if num_decode:
        max_blocks = max(len(ids) for ids, _ in decode_rows)
        table = np.zeros((num_decode, max_blocks), dtype=np.int64)
        for row, (ids, _) in enumerate(decode_rows):
            table[row, : len(ids)] = ids
        decode_tables = torch.from_numpy(table).to(device)
        decode_lens = torch.tensor([n for _, n in decode_rows], device=device)

    sample_rows: list[int] = []
    for i, chunk in enumerate(chunks):
        _, end = hidden_rows[i]
        sample_rows.extend(range(end - chunk.num_sampled, end))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        num_decode=num_decode,
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        prefills=spans,
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, device=device),
        positions=torch.tensor(positions, device=device),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
        sample_ranges=sample_ranges(chunks),
    )


def sample_ranges(chunks: list[Chunk]) -> list[tuple[int, int]]:
    """Per chunk, in the given order: its rows in the step's logits (the sampled positions)."""
    ranges, first = [], 0
    for chunk in chunks:
        ranges.append((first, first + chunk.num_sampled))
        first += chunk.num_sampled
    return ranges
