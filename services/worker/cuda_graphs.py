"""CUDA graphs for decode-only steps: the model forward (token ids -> final hidden states) of a
decode batch, padded up to the nearest captured batch size and replayed from persistent inputs.

At batch 1 a decode step of a 0.6B model launches ~400 kernels whose device time is well under
a millisecond; launching them from Python costs several. A replay launches them all at once.

What is captured, and why only that:
- Only steps whose every chunk is one token (decode, or a one-token prefill chunk). Prefill and
  mixed steps have per-request query lengths and a Python loop over prefill spans; speculative
  verify steps have k + 1 query positions per request with k adapted per request. Their shapes
  vary step to step, so they run eagerly. Capturing verify steps (per (batch, k) shapes through
  the varlen kernel) is future work.
- Only the model forward, not the logits or the sampler: logits are computed eagerly for the
  sampled rows, and sampling, logprobs and rejection sampling stay exactly as on the eager path.

Inside the graph every launch shape is fixed at capture time: block tables are padded to
max_model_len / block_size columns (the decode kernel sizes its split-K grid from the table
width, never from the step's longest context), and nothing in the forward reads a device value
on the host. Padding rows hold token 0 at position 0, write their K/V to a scratch block that
the scheduler never hands out, and attend only to that one slot; their outputs are dropped.

`capture=False` runs the very same path (padding, persistent buffers, copy-in, slice-out) with a
plain eager forward over the persistent buffers instead of a replay. That is how CPU tests cover
everything but the capture itself, which needs CUDA (benchmarks/gpu_check.sh checks it there).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time

import numpy as np
import torch

from stoker.services.worker.attention_metadata import AttentionMetadata
from stoker.services.worker.models.llama import LlamaForCausalLM
from stoker.services.worker.step_inputs import Chunk

log = logging.getLogger("stoker.worker")
# Device memory a captured graph holds outside torch's allocator (its executable form), a
# conservative guess used when sizing the KV cache before anything is captured.
GRAPH_OVERHEAD_BYTES = 2 * 1024**2
_FIELDS = 4  # per row: token id, position, slot, context length; then the block table


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, ending at max_batch."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += range(8, max_batch + 1, 8)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclasses.dataclass
class _Entry:
    """One padded batch size: views of the persistent buffer, and its graph once captured."""

    meta: AttentionMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # the graph's output buffer


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_batch)
        self.width = -(-max_model_len // block_size)  # block table columns: the longest request
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        # One int64 buffer: block tables first, row r always at [r * width, (r + 1) * width)
        # whatever the padded size, so columns past a request's blocks only ever hold block ids
        # from earlier steps; then, at a fixed offset, [ids | positions | slots | context lens]
        # of B elements each. A step is two host-to-device copies. int64 throughout: the torch
        # references index with it, triton widens anyway.
        self._fields_at = self.sizes[-1] * self.width
        numel = self._fields_at + self.sizes[-1] * _FIELDS
        self._device_buf = torch.zeros(numel, dtype=torch.int64, device=device)
        self._host_buf = torch.zeros(numel, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host = self._host_buf.numpy()
        # Marks the last host-to-device copy, so the pinned buffer is not rewritten under it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._entries = {size: self._entry(size) for size in self.sizes}
        self._pending: tuple[_Entry, int] | None = None
        self.num_replays = 0  # decode steps served by this path (tests, logs)
        if capture:
            self._capture()

    def _entry(self, size: int) -> _Entry:
        buf, at = self._device_buf, self._fields_at
        ids, positions, slots, lens = (
            buf[at + i * size : at + (i + 1) * size] for i in range(_FIELDS)
        )
        tables = buf[: size * self.width].view(size, self.width)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode=size,
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefills=[],
        )
        return _Entry(meta, ids, positions)

    def accepts(self, chunks: list[Chunk]) -> bool:
        width = self.width
        return 0 < len(chunks) <= self.sizes[-1] and all(
            len(c.token_ids) == 1 and len(c.block_ids) <= width for c in chunks
        )

    def accepts_rows(self, widths: np.ndarray) -> bool:
        """A plain decode batch (one token per request), given each request's block count."""
        return 0 < len(widths) <= self.sizes[-1] and int(widths.max()) <= self.width

    def prepare(self, chunks: list[Chunk]) -> None:
        """Pad the batch to the next captured size and copy its inputs into the buffers."""
        num = len(chunks)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=num)
        ids = [c.token_ids[0] for c in chunks]
        size = self._size(num)
        self._fill(size, ids, starts, block_ids=[c.block_ids for c in chunks])
        self._pending = (self._entries[size], num)

    def prepare_rows(
        self, token_ids: np.ndarray, positions: np.ndarray, tables: np.ndarray
    ) -> None:
        """prepare() for a plain decode batch given as arrays: tables are the requests' rows
        of a BlockTable (zero past their blocks), at most `width` columns."""
        num = len(token_ids)
        size = self._size(num)
        self._fill(size, token_ids, positions, tables=tables)
        self._pending = (self._entries[size], num)

    def _size(self, num: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num)]

    def run(self) -> torch.Tensor:
        """Final hidden states of the prepared batch's real rows, [num, hidden]. The tensor is
        the graph's output buffer: read it before the next step."""
        assert self._pending is not None, "prepare() first"
        entry, num = self._pending
        self._pending = None
        if entry.graph is not None:
            entry.graph.replay()
            hidden = entry.hidden
        else:
            hidden = self._forward(entry)
        self.num_replays += 1
        assert hidden is not None
        return hidden[:num]

    def _fill(
        self,
        size: int,
        token_ids: list[int] | np.ndarray,
        starts: np.ndarray,
        block_ids: list[list[int]] | None = None,
        tables: np.ndarray | None = None,
    ) -> None:
        """The first len(starts) rows from the step, the rest padding. Each row's block table
        comes from block_ids (its own list) or tables (gathered rows, [num, <= width])."""
        if self._copied is not None:
            self._copied.synchronize()  # no-op once the copy is done (the sampler synced)
        num, width, bs, at = len(starts), self.width, self.block_size, self._fields_at
        fields = self._host[at : at + _FIELDS * size]
        ids, positions, slots, lens = (fields[i * size : (i + 1) * size] for i in range(_FIELDS))
        host_tables = self._host[: size * width].reshape(size, width)
        ids[:num] = token_ids
        positions[:num] = starts
        lens[:num] = starts + 1
        # Columns past a request's blocks keep ids from earlier steps (or 0): always valid block
        # ids, and never read below the context length.
        if tables is not None:
            host_tables[:num, : tables.shape[1]] = tables
        for row, blocks in enumerate(block_ids or ()):
            host_tables[row, : len(blocks)] = blocks
        slots[:num] = host_tables[np.arange(num), starts // bs] * bs + starts % bs
        ids[num:], positions[num:], lens[num:] = 0, 0, 1
        slots[num:] = self.scratch_block * bs
        host_tables[num:, 0] = self.scratch_block
        for lo, hi in ((0, size * width), (at, at + _FIELDS * size)):
            self._device_buf[lo:hi].copy_(self._host_buf[lo:hi], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, entry: _Entry) -> torch.Tensor:
        return self.model(entry.input_ids, entry.positions, self.kv_caches, entry.meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        # Tensor parallel: the forward holds NCCL all-reduces, which graphs capture like any
        # kernel; every rank captures the same sizes in the same order (same config), the
        # warm-ups below run those collectives for real first (NCCL sets up its channels
        # outside capture), and thread-local capture keeps NCCL's watchdog thread, which polls
        # events, from invalidating the capture.
        comm = getattr(self.model, "comm", None)
        mode = "global" if comm is None else "thread_local"
        if comm is not None:
            comm.barrier()
        # Largest first: the smaller graphs reuse the shared pool's intermediate buffers.
        for size in reversed(self.sizes):
            entry = self._entries[size]
            # All padding: capture writes to the scratch block only.
            self._fill(size, [], np.zeros(0, np.int64))
            # Warm-up outside capture, on a side stream as torch recommends: triton compiles
            # this size's specialisations and cuBLAS picks its kernels before recording.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(entry)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                entry.hidden = self._forward(entry)
            entry.graph = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        log.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d) in %.1f s, %.0f MiB",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - started,
            (free_before - free_after) / 1024**2,
        )
