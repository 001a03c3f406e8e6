"""Step layout: short chunks (decodes, verifies, short prompts) become decode rows, one per
position with its own context length; long chunks become prefill spans."""

from __future__ import annotations

import torch

from stoker.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, store_kv
from stoker.services.worker.block_table import BlockTable
from stoker.services.worker.step_inputs import MAX_DECODE_CHUNK, Chunk, build_step_inputs

BS = 4


def test_short_chunks_become_decode_rows_and_long_ones_prefill_spans():
    long = Chunk(list(range(100, 100 + MAX_DECODE_CHUNK + 1)), 0, [7, 8, 9, 10, 11], 1)
    decode = Chunk([5], 9, [1, 2, 3], 1)
    verify = Chunk([6, 60, 61, 62], 6, [4, 5, 6], 4)  # positions 6..9, all four sampled
    short_prompt = Chunk([1, 2, 3], 0, [12], 1)
    inputs = build_step_inputs([long, decode, verify, short_prompt], BS, torch.device("cpu"))
    meta = inputs.meta

    assert meta.num_decode == 1 + 4 + 3
    assert inputs.input_ids[: meta.num_decode].tolist() == [5, 6, 60, 61, 62, 1, 2, 3]
    assert inputs.positions[: meta.num_decode].tolist() == [9, 6, 7, 8, 9, 0, 1, 2]
    assert meta.decode_context_lens.tolist() == [10, 7, 8, 9, 10, 1, 2, 3]
    tables = meta.decode_block_tables.tolist()
    assert tables[0][:3] == [1, 2, 3] and all(row[:3] == [4, 5, 6] for row in tables[1:5])
    assert inputs.meta.slot_mapping[:5].tolist() == [
        3 * BS + 1,
        5 * BS + 2,
        5 * BS + 3,
        6 * BS,
        6 * BS + 1,
    ]
    (span,) = meta.prefills
    assert (span.start, span.end, span.context_len) == (8, 8 + len(long.token_ids), 17)
    # Logits rows follow the chunks' given order: long (last position), decode, verify x4, short.
    assert inputs.sample_rows.tolist() == [span.end - 1, 0, 1, 2, 3, 4, 7]
    assert inputs.sample_ranges == [(0, 1), (1, 2), (2, 6), (6, 7)]


def test_verify_rows_on_the_decode_path_equal_prefill_attention_over_the_prefix():
    gen = torch.Generator().manual_seed(0)
    hq, hk, d, num_blocks = 4, 2, 16, 8
    kc = torch.zeros(num_blocks, BS, hk, d)
    vc = torch.zeros(num_blocks, BS, hk, d)
    blocks, context = [3, 6, 1, 4], 13  # a 9-token prefix, then a 4-position verify chunk
    positions = torch.arange(context)
    slots = torch.tensor(blocks)[positions // BS] * BS + positions % BS
    store_kv(
        kc,
        vc,
        torch.randn(context, hk, d, generator=gen),
        torch.randn(context, hk, d, generator=gen),
        slots,
    )
    chunk = Chunk([1, 2, 3, 4], context - 4, blocks, 4)
    meta = build_step_inputs([chunk], BS, torch.device("cpu")).meta
    q = torch.randn(4, hq, d, generator=gen)
    rows = paged_decode_attention(
        q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, d**-0.5
    )
    span = paged_prefill_attention(q, kc, vc, torch.tensor(blocks), context, d**-0.5)
    torch.testing.assert_close(rows, span, rtol=1e-5, atol=1e-5)


def test_short_chunks_stay_prefill_spans_where_decode_attention_would_gather(monkeypatch):
    """Decode rows only pay off with a kernel that reads the cache in place; the reference
    gathers each row's whole context, so a k + 1 verify would gather it k + 1 times."""
    from stoker.kernels import cpu_ops
    from stoker.kernels.dispatch import decode_reads_cache_in_place

    cpu = torch.device("cpu")
    native = cpu_ops.load() is not None
    assert decode_reads_cache_in_place(cpu, torch.float32, 12, 4, 64) == native
    assert decode_reads_cache_in_place(cpu, torch.bfloat16, 12, 4, 64) == native
    assert not decode_reads_cache_in_place(cpu, torch.float16, 12, 4, 64)  # no float16 kernel
    assert not decode_reads_cache_in_place(cpu, torch.float32, 12, 4, 48)  # no kernel shape
    monkeypatch.setenv("STOKER_FORCE_TORCH_KERNELS", "1")
    assert not decode_reads_cache_in_place(cpu, torch.float32, 12, 4, 64)

    verify = Chunk([6, 60, 61, 62], 6, [4, 5, 6], 4)
    meta = build_step_inputs([Chunk([5], 9, [1, 2, 3], 1), verify], BS, cpu, 1).meta
    assert meta.num_decode == 1
    (span,) = meta.prefills
    assert (span.start, span.end, span.context_len) == (1, 5, 10)


def test_random_layouts_match_the_per_row_definition():
    """Mixed steps (decodes, verifies, short and long prompt chunks, shuffled): every tensor is
    what the layout's definition gives row by row."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        chunks = []
        for _ in range(rng.randrange(1, 12)):
            n = rng.choice([1, 1, 1, 3, 5, MAX_DECODE_CHUNK, MAX_DECODE_CHUNK + 7])
            start = rng.randrange(0, 40)
            blocks = rng.sample(range(200), -(-(start + n) // BS) + rng.randrange(0, 3))
            ids = [rng.randrange(1000) for _ in range(n)]
            chunks.append(Chunk(ids, start, blocks, rng.choice([0, 1, min(n, 2)])))
        inputs = build_step_inputs(chunks, BS, torch.device("cpu"))
        short = [c for c in chunks if len(c.token_ids) <= MAX_DECODE_CHUNK]
        ordered = short + [c for c in chunks if len(c.token_ids) > MAX_DECODE_CHUNK]
        rows = [(c, c.start + j) for c in ordered for j in range(len(c.token_ids))]
        assert inputs.input_ids.tolist() == [c.token_ids[p - c.start] for c, p in rows]
        assert inputs.positions.tolist() == [p for _, p in rows]
        slots = [c.block_ids[p // BS] * BS + p % BS for c, p in rows]
        assert inputs.meta.slot_mapping.tolist() == slots
        num_decode = sum(len(c.token_ids) for c in short)
        assert inputs.meta.num_decode == num_decode
        if num_decode:
            width = max(len(c.block_ids) for c in short)
            tables = [c.block_ids + [0] * (width - len(c.block_ids)) for c, _ in rows[:num_decode]]
            assert inputs.meta.decode_block_tables.tolist() == tables
            assert inputs.meta.decode_context_lens.tolist() == [p + 1 for _, p in rows[:num_decode]]
        else:
            assert inputs.meta.decode_block_tables is None
        end_row, ends = 0, {}
        for c in ordered:
            end_row += len(c.token_ids)
            ends[id(c)] = end_row
        expected = [r for c in chunks for r in range(ends[id(c)] - c.num_sampled, ends[id(c)])]
        assert inputs.sample_rows.tolist() == expected
        for dtype_of in (inputs.input_ids, inputs.positions, inputs.meta.slot_mapping):
            assert dtype_of.dtype == torch.int64


def test_block_table_rows_give_the_same_layout_as_the_block_lists():
    """The worker's persistent BlockTable (rows reused, grown past its first size in rows and
    columns, blocks appended as decoding fills them) yields the same step inputs as the lists."""
    import random

    rng = random.Random(1)
    table = BlockTable(num_cols=2, num_rows=2)
    for _ in range(40):
        chunks = []
        for _ in range(rng.randrange(1, 10)):
            n = rng.choice([1, 1, 3, MAX_DECODE_CHUNK, MAX_DECODE_CHUNK + 2])
            start = rng.randrange(0, 40)
            blocks = rng.sample(range(200), -(-(start + n) // BS) + rng.randrange(0, 3))
            cut = rng.randrange(0, len(blocks) + 1)  # some blocks came later, one at a time
            row = table.add(blocks[:cut])
            for b in blocks[cut:]:
                table.append(row, [b])
            ids = [rng.randrange(1000) for _ in range(n)]
            chunks.append(Chunk(ids, start, blocks, rng.choice([0, 1]), row))
        cpu = torch.device("cpu")
        lists = build_step_inputs(chunks, BS, cpu)
        rows = build_step_inputs(chunks, BS, cpu, block_table=table.table)
        a, b = lists.meta.decode_block_tables, rows.meta.decode_block_tables
        assert (a is None and b is None) or torch.equal(a, b)
        assert torch.equal(lists.meta.slot_mapping, rows.meta.slot_mapping)
        for c in rng.sample(chunks, len(chunks)):  # released rows are reused, zeroed
            table.release(c.table_row)
    assert table.table.shape[0] > 2 and table.table.shape[1] > 2
    assert not table.table.any()


def test_plain_decode_steps_from_block_table_rows_equal_the_general_layout():
    """Every chunk one token that samples: build_step_inputs with a BlockTable takes the array
    builder (build_decode_inputs), which must give what the per-chunk layout gives."""
    import random

    rng = random.Random(2)
    cpu = torch.device("cpu")
    for _ in range(30):
        table = BlockTable(num_cols=3, num_rows=4)
        chunks = []
        for _ in range(rng.randrange(1, 40)):
            start = rng.randrange(0, 90)
            blocks = rng.sample(range(500), -(-(start + 1) // BS) + rng.randrange(0, 2))
            chunks.append(Chunk([rng.randrange(1000)], start, blocks, 1, table.add(blocks)))
        general = build_step_inputs(chunks, BS, cpu)
        plain = build_step_inputs(chunks, BS, cpu, block_table=table.table)
        for name in ("input_ids", "positions", "sample_rows"):
            assert torch.equal(getattr(plain, name), getattr(general, name)), name
        assert plain.sample_ranges == general.sample_ranges
        m, g = plain.meta, general.meta
        assert m.num_decode == g.num_decode == len(chunks) and not m.prefills
        assert torch.equal(m.slot_mapping, g.slot_mapping)
        assert torch.equal(m.decode_block_tables, g.decode_block_tables)
        assert torch.equal(m.decode_context_lens, g.decode_context_lens)
        for t in (plain.input_ids, plain.positions, m.slot_mapping, m.decode_context_lens):
            assert t.dtype == torch.int64


def test_prefill_spans_are_also_laid_out_as_one_batch_for_the_native_kernel():
    decode = Chunk([5], 9, [1, 2, 3], 1)
    fresh = Chunk(list(range(20)), 0, [7, 8, 9, 10, 11], 1)  # 20 tokens from position 0
    tail = Chunk(list(range(17)), 30, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32], 1)
    meta = build_step_inputs([decode, fresh, tail], BS, torch.device("cpu")).meta
    assert meta.num_decode == 1
    assert meta.prefill_bounds.tolist() == [0, 20, 37]  # rows after the decode rows
    assert meta.prefill_lens.tolist() == [20, 47]
    tables = meta.prefill_tables.tolist()
    assert tables[0][:5] == [7, 8, 9, 10, 11] and tables[1] == tail.block_ids[:12]
    only_decodes = build_step_inputs([decode], BS, torch.device("cpu")).meta
    assert only_decodes.prefill_tables is None
