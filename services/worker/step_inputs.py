"""Flatten one step's chunks of tokens into model inputs and attention metadata.

Shared by the target model and the draft model. Chunks of one token go first (the decode
path), longer chunks follow as prefill spans; each chunk says how many of its last positions
need logits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

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


def build_step_inputs(chunks: list[Chunk], block_size: int, device: torch.device) -> StepInputs:
    bs = block_size
    order = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    num_decode = len(order)
    order += [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    hidden_rows: dict[int, tuple[int, int]] = {}  # chunk index -> its rows in the flat batch
    spans: list[PrefillSpan] = []
    for rank, i in enumerate(order):
        chunk = chunks[i]
        start_row = len(input_ids)
        end_pos = chunk.start + len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        if rank < num_decode:
            pos = chunk.start
            positions.append(pos)
            slots.append(chunk.block_ids[pos // bs] * bs + pos % bs)
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

    decode_tables = decode_lens = None
    if num_decode:
        decodes = [chunks[i] for i in order[:num_decode]]
        max_blocks = max(len(c.block_ids) for c in decodes)
        table = np.zeros((num_decode, max_blocks), dtype=np.int64)
        for row, c in enumerate(decodes):
            table[row, : len(c.block_ids)] = c.block_ids
        decode_tables = torch.from_numpy(table).to(device)
        decode_lens = torch.tensor([c.start + 1 for c in decodes], device=device)

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
