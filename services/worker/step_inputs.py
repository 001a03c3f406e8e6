"""Flatten one step's chunks of tokens into model inputs and attention metadata.

Shared by the target model and the draft model. Short chunks go first, on the decode path (one
row per position); longer chunks follow as prefill spans. Each chunk says how many of its last
positions need logits, and how many of its first positions need them for prompt logprobs.
"""

from __future__ import annotations

import dataclasses
from itertools import chain

import numpy as np
import torch

from stoker.common.model_config import ModelConfig
from stoker.kernels.dispatch import decode_reads_cache_in_place
from stoker.services.worker.attention_metadata import AttentionMetadata, PrefillSpan


@dataclasses.dataclass(slots=True)
class Chunk:
    token_ids: list[int]  # tokens to compute, at positions start, start + 1, ...
    start: int
    block_ids: list[int]  # the request's block table (covers start + len(token_ids))
    num_sampled: int  # logits wanted for this many trailing positions (0, 1, or k + 1 to verify)
    table_row: int = -1  # the request's row in a BlockTable, when the caller keeps one
    # Logits wanted for this many leading positions too: a prompt chunk of a request that asked
    # for prompt logprobs (services/worker/prompt_logprobs.py).
    num_prompt_rows: int = 0


@dataclasses.dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states to turn into logits
    sample_ranges: list[tuple[int, int]]  # per chunk, in the given order: its rows in the logits
    # With `trim_last_layer`, where the step has prompt chunks on the CPU: the last layer's
    # metadata (AttentionMetadata.out_rows), and the sampled rows among that layer's outputs.
    last_layer_meta: AttentionMetadata | None = None
    last_layer_sample_rows: torch.Tensor | None = None
    # The chunks' prompt-logprob rows (Chunk.num_prompt_rows), in chunk order; None when no
    # chunk has any. Rows of the hidden states, and of the trimmed last layer's outputs.
    prompt_rows: torch.Tensor | None = None
    last_layer_prompt_rows: torch.Tensor | None = None


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
    block_table: np.ndarray | None = None,
    trim_last_layer: bool = False,
) -> StepInputs:
    """max_decode_chunk: the longest chunk laid out as decode rows (see `max_decode_chunk`).
    block_table: a BlockTable's rows, which every chunk's table_row then names.
    trim_last_layer: also build the last layer's metadata that keeps only the rows that sample
    (every prompt row but a chunk's last needs K/V from the last layer, not an output).

    The decode rows are laid out with numpy over all short chunks at once: at hundreds of
    decoding requests a per-row Python loop cost milliseconds of host time per step."""
    bs = block_size
    plain = chunks and all(len(c.token_ids) == 1 == c.num_sampled for c in chunks)
    if plain and block_table is not None:  # every chunk a decode: no per-row layout needed
        n = len(chunks)
        return build_decode_inputs(
            np.fromiter((c.token_ids[0] for c in chunks), np.int64, n),
            np.fromiter((c.start for c in chunks), np.int64, n),
            block_table[
                np.fromiter((c.table_row for c in chunks), np.int64, n),
                : max(len(c.block_ids) for c in chunks),
            ],
            bs,
            device,
        )
    is_short = [len(c.token_ids) <= max_decode_chunk for c in chunks]
    short = [c for c, s in zip(chunks, is_short) if s]
    long_chunks = [c for c, s in zip(chunks, is_short) if not s]
    input_ids = list(chain.from_iterable(c.token_ids for c in short))
    num_decode = len(input_ids)
    short_ends: list[int] = []  # each short chunk's end row in the flat batch, in short order
    long_ends: list[int] = []
    decode_tables = decode_lens = None
    positions = slots = np.zeros(0, dtype=np.int64)
    if short:
        n = len(short)
        counts = np.fromiter((len(c.token_ids) for c in short), np.int64, n)
        starts = np.fromiter((c.start for c in short), np.int64, n)
        widths = np.fromiter((len(c.block_ids) for c in short), np.int64, n)
        if block_table is not None:  # columns past a row's blocks are zero there too
            rows = np.fromiter((c.table_row for c in short), np.int64, n)
            tables = block_table[rows, : int(widths.max())]
        else:
            tables = np.zeros((n, int(widths.max())), dtype=np.int64)
            # Row-major True positions are each chunk's columns 0..width-1, in chunk order.
            tables[np.arange(tables.shape[1]) < widths[:, None]] = np.fromiter(
                chain.from_iterable(c.block_ids for c in short), np.int64, int(widths.sum())
            )
        row_ends = np.cumsum(counts)
        if num_decode == n:  # one row per chunk: plain decodes
            row_chunk, positions = np.arange(n), starts
        else:
            row_chunk = np.repeat(np.arange(n), counts)
            positions = starts[row_chunk] + np.arange(num_decode) - (row_ends - counts)[row_chunk]
        slots = tables[row_chunk, positions // bs] * bs + positions % bs
        decode_tables = torch.from_numpy(tables if num_decode == n else tables[row_chunk])
        decode_tables = decode_tables.to(device)
        decode_lens = torch.from_numpy(positions + 1).to(device)
        short_ends = row_ends.tolist()
    long_positions: list[int] = []
    long_slots: list[int] = []
    spans: list[PrefillSpan] = []
    for chunk in long_chunks:
        start_row = len(input_ids)
        end_pos = chunk.start + len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        pos_arr = np.arange(chunk.start, end_pos)
        long_positions.extend(pos_arr.tolist())
        blocks = np.asarray(chunk.block_ids, dtype=np.int64)
        long_slots.extend((blocks[pos_arr // bs] * bs + pos_arr % bs).tolist())
        table = None
        if chunk.start > 0:
            table = torch.tensor(chunk.block_ids[: -(-end_pos // bs)], device=device)
        spans.append(PrefillSpan(start_row, len(input_ids), end_pos, table))
        long_ends.append(len(input_ids))

    sample_rows: list[int] = []
    prompt_rows: list[int] = []
    next_short, next_long = iter(short_ends), iter(long_ends)
    for chunk, s in zip(chunks, is_short):
        end = next(next_short) if s else next(next_long)
        sample_rows.extend(range(end - chunk.num_sampled, end))
        if chunk.num_prompt_rows:
            first = end - len(chunk.token_ids)
            prompt_rows.extend(range(first, first + chunk.num_prompt_rows))
    if long_chunks:
        positions = np.concatenate([positions, np.asarray(long_positions, dtype=np.int64)])
        slots = np.concatenate([slots, np.asarray(long_slots, dtype=np.int64)])
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decode=num_decode,
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        prefills=spans,
    )
    if long_chunks and device.type == "cpu":
        ends = [span.context_len for span in spans]
        widths = [-(-end // bs) for end in ends]
        tables = np.zeros((len(spans), max(widths)), dtype=np.int64)
        for i, (chunk, width) in enumerate(zip(long_chunks, widths)):
            tables[i, :width] = chunk.block_ids[:width]
        meta.prefill_tables = torch.from_numpy(tables)
        meta.prefill_bounds = torch.tensor([0] + [s.end - num_decode for s in spans])
        meta.prefill_lens = torch.tensor(ends)
    inputs = StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
        sample_ranges=sample_ranges(chunks),
    )
    if prompt_rows:
        inputs.prompt_rows = torch.tensor(prompt_rows, dtype=torch.int64, device=device)
    if trim_last_layer and meta.prefill_tables is not None:
        _add_last_layer_rows(inputs, long_chunks, num_decode)
    return inputs


def build_decode_inputs(
    token_ids: np.ndarray,
    positions: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """A plain decode step's inputs: one row per request, at its position, each sampling.
    tables: each row's block ids, [n, columns], zero past its blocks (a BlockTable gather).
    Arrays in, arrays out: no per-request Python, which at hundreds of decoding requests is
    most of a step's host time."""
    n = len(token_ids)
    slots = tables[np.arange(n), positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        num_decode=n,
        decode_block_tables=torch.from_numpy(tables).to(device),
        decode_context_lens=torch.from_numpy(positions + 1).to(device),
        prefills=[],
    )
    return StepInputs(
        input_ids=torch.from_numpy(token_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        sample_rows=torch.arange(n, device=device),
        sample_ranges=[(i, i + 1) for i in range(n)],
    )


def _add_last_layer_rows(inputs: StepInputs, long_chunks: list[Chunk], num_decode: int) -> None:
    """The last layer keeps every decode row and each prompt chunk's sampled tail. Prompt rows
    are most of a prefill step's rows and rarely sample, so its attention output, o_proj and
    MLP then run on a few rows instead of all of them. A chunk with prompt-logprob rows keeps
    all its rows (the kept rows of a span are a suffix of it, as the kernels read them)."""
    meta = inputs.meta
    kept = [0]
    out_rows = list(range(num_decode))
    for span, chunk in zip(meta.prefills, long_chunks):
        keep = len(chunk.token_ids) if chunk.num_prompt_rows else chunk.num_sampled
        out_rows.extend(range(span.end - keep, span.end))
        kept.append(kept[-1] + keep)
    inputs.last_layer_meta = dataclasses.replace(
        meta,
        prefill_bounds=torch.tensor(kept, dtype=torch.int64),
        out_rows=torch.tensor(out_rows, dtype=torch.int64),
    )
    # Every sampled row is kept, and out_rows ascends: each one's index among the kept rows.
    inputs.last_layer_sample_rows = torch.searchsorted(
        inputs.last_layer_meta.out_rows, inputs.sample_rows
    )
    if inputs.prompt_rows is not None:
        inputs.last_layer_prompt_rows = torch.searchsorted(
            inputs.last_layer_meta.out_rows, inputs.prompt_rows
        )


def sample_ranges(chunks: list[Chunk]) -> list[tuple[int, int]]:
    """Per chunk, in the given order: its rows in the step's logits (the sampled positions)."""
    ranges, first = [], 0
    for chunk in chunks:
        ranges.append((first, first + chunk.num_sampled))
        first += chunk.num_sampled
    return ranges
