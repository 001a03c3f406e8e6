"""The proposer interface: what the runner asks of a model that drafts tokens for the target to
verify (docs/speculation.md). Two implement it: the draft model (services/worker/drafter.py) and
the EAGLE head (services/worker/eagle/proposer.py).

A proposer keeps its own paged KV cache on the target's block ids, so the scheduler's block
accounting covers both, and catches up lazily, at its next proposal, on tokens it has not seen.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch

from stoker.common.sampling_params import SamplingParams
from stoker.services.worker.step_inputs import Chunk

# (req_id, known token ids, block ids, params, k, output tokens so far)
ProposalItem = tuple[str, list[int], list[int], SamplingParams, int, int]
# The k draft ids and, for sampled requests, their proposal distributions q ([k, vocab]).
Proposal = tuple[list[int], torch.Tensor | None]
Zeros = Callable[[tuple[int, ...]], torch.Tensor]  # zeroed KV memory of a shape


class Proposer(ABC):
    # Target layers whose outputs the runner hands to `record` after each eager forward; ()
    # for a proposer that reads token ids alone.
    tap_layers: tuple[int, ...] = ()

    @abstractmethod
    def kv_block_bytes(self, elem_size: int) -> int:
        """Its K and V of one block: the target's KV sizing counts it per block."""

    @abstractmethod
    def allocate_kv(self, num_blocks: int, zeros: Zeros) -> None:
        """Its cache, as many blocks as the target's pool, once the pool is sized."""

    @abstractmethod
    def propose(self, items: list[ProposalItem]) -> list[Proposal]:
        """Per item, its k drafts (and q where the request samples)."""

    @abstractmethod
    def accept(self, req_id: str, num_known_before: int, num_drafts: int, accepted: int) -> None:
        """After a verify: only the accepted drafts' state stays valid."""

    @abstractmethod
    def drop(self, req_id: str) -> None:
        """Forget a finished, aborted or preempted request."""

    @abstractmethod
    def record(
        self,
        chunks: list[Chunk],
        req_ids: Iterable[str],
        taps: list[torch.Tensor],
        decode_chunk: int,
    ) -> None:
        """After each eager target forward over chunks (one per req_id): taps holds the outputs
        of `tap_layers`, in build_step_inputs' row order (decode_chunk: its layout's split)."""
