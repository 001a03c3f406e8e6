"""The worker's per-request state, kept across steps so the scheduler sends only what changed,
and a request's share of one step."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import numpy as np
import torch

from stoker.common.sampling_params import SamplingParams
from stoker.services.worker.sampling_state import RequestSampling

IdsT = TypeVar("IdsT", int, np.ndarray)


def null_next_token(last: IdsT, vocab_size: int) -> IdsT:
    """The null model's next token after `last` (an id, or an array of them): fixed and cheap,
    so the host pipeline runs without a forward."""
    return (last * 7 + 1) % vocab_size


@dataclasses.dataclass(slots=True)
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + sampled outputs
    prompt_len: int
    params: SamplingParams
    block_ids: list[int]
    num_computed: int  # tokens whose K/V are in the cache
    sampling: RequestSampling  # penalty counts and logit_bias on the device
    table_row: int = -1  # its row in the runner's BlockTable (a mirror of block_ids)


@dataclasses.dataclass(slots=True)
class Scheduled:
    """A request's share of this step: num_tokens to compute, or a verify of k drafts."""

    state: RequestState
    num_tokens: int
    drafts: list[int] = dataclasses.field(default_factory=list)
    k: int = 0  # drafts to verify (from the scheduler's n-gram ids or the proposer)
    draft_probs: torch.Tensor | None = None
