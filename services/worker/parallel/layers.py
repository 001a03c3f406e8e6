"""The sharded layers. A model is built with per-rank shapes (shard.shard_config) and then
`parallelize` swaps in these subclasses, so the single-rank classes keep their exact code path
and every tensor-parallel difference sits here:

- attention and the (gated or expert) MLP end in a row-parallel projection: one all-reduce each;
- the embedding is vocab parallel: ids outside this rank's rows look up zeros, then an
  all-reduce (one non-zero term per row, so the sum is exact);
- the LM head is vocab parallel: local logits, all-gathered, padding columns cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stoker.services.worker.attention_metadata import AttentionMetadata
from stoker.services.worker.models.layers import (
    Attention,
    CausalLM,
    GatedMLP,
    KVCache,
    Rope,
    linear,
    param,
)
from stoker.services.worker.models.moe import SparseMoE
from stoker.services.worker.parallel.comm import Communicator


class ParallelAttention(Attention):
    comm: Communicator

    def forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(hidden, rope, kv_cache, meta))


class ParallelGatedMLP(GatedMLP):
    comm: Communicator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class ParallelSparseMoE(SparseMoE):
    """Every expert split alike (router replicated), so one all-reduce sums experts and ranks."""

    comm: Communicator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class ParallelCausalLM(CausalLM):
    """Mixed in ahead of a family's class (see `_parallel_class`)."""

    comm: Communicator
    vocab_first: int
    vocab_rows: int

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_first
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        hidden = self.comm.all_reduce(hidden.masked_fill(outside[:, None], 0.0))
        if self._embed_scale is not None:
            hidden = hidden * self._embed_scale
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            local = linear(hidden, self.packed_lm_head)
        else:
            local = F.linear(hidden, self.lm_head_weight())
        return self.soft_cap(self.comm.all_gather_last(local)[:, : self.cfg.vocab_size])


_SWAPS = {Attention: ParallelAttention, GatedMLP: ParallelGatedMLP, SparseMoE: ParallelSparseMoE}
_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type[CausalLM]) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Parallel{cls.__name__}", (ParallelCausalLM, cls), {})
    return _CLASSES[cls]


def parallelize(model: CausalLM, comm: Communicator, vocab_size: int) -> None:
    """In place, on the meta device before loading: the sharded classes, and embedding / LM
    head parameters of this rank's padded vocab rows."""
    for module in model.modules():
        swap = _SWAPS.get(type(module))
        if swap is not None:
            module.__class__ = swap
            module.comm = comm
    first, rows = comm.shard.vocab_rows(vocab_size)
    hidden = model.cfg.hidden_size
    model.embed_tokens = param(rows, hidden)
    if model.lm_head is not None:
        model.lm_head = param(rows, hidden)
    model.__class__ = _parallel_class(type(model))
    model.comm, model.vocab_first, model.vocab_rows = comm, first, rows
