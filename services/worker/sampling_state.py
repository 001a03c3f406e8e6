"""Per-request sampling state kept on the worker's device, and the per-step batch built from it.

A request that uses penalties keeps its output-token counts as a [V] tensor updated with each
step's new tokens (and, for the repetition penalty, which tokens its prompt holds), and a
request with a logit_bias keeps it as two small tensors. So a step's cost for these options is
a gather over the rows that use them: no token lists are copied or padded, and requests that use
none of them cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stoker.common.sampling_params import SamplingParams
from stoker.services.worker.sampler import (
    SamplingBatch,
    bias_tensors,
    count_tokens,
    gather_bias,
    penalties_for,
)


class RequestSampling:
    """Built once when the worker first sees a request (or again after a preemption)."""

    __slots__ = ("params", "counts", "prompt_seen", "bias", "argmax_only")

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        output: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.params = params
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        if params.uses_penalties:
            self.counts = count_tokens(output, vocab_size, device)
            if params.repetition_penalty != 1.0:
                self.prompt_seen = count_tokens(prompt, vocab_size, device) > 0
        self.bias = bias_tensors(params, device) if params.logit_bias else None
        # Its tokens are the raw logits' argmax and nothing else is read from them, so the
        # runner may skip the full LM head (services/worker/greedy_head.py).
        self.argmax_only = (
            params.greedy and self.counts is None and self.bias is None and params.logprobs is None
        )  # a grammar's mask applies to the argmax too (worker/greedy_head.py)

    def add(self, tokens: Sequence[int]) -> None:
        """Count newly generated tokens (one small device op; none without penalties)."""
        if self.counts is not None and tokens:
            index = torch.tensor(list(tokens), dtype=torch.int64, device=self.counts.device)
            self.counts.index_add_(0, index, torch.ones(len(index), device=index.device))


@dataclass
class Row:
    """One logits row to sample: a plain step's single row, or one of a verify's k + 1."""

    state: RequestSampling
    output_position: int  # tokens the request generated before this row's token
    drafts_before: Sequence[int] = ()  # a verify row sees the drafts ahead of it as output


def batch_for(rows: list[Row], vocab_size: int, device: torch.device) -> SamplingBatch:
    params = [r.state.params for r in rows]
    pen_rows = [i for i, r in enumerate(rows) if r.state.counts is not None]
    penalties = None
    if pen_rows:
        counts = torch.stack([_counts(rows[i].state) for i in pen_rows])
        extra = [(j, t) for j, i in enumerate(pen_rows) for t in rows[i].drafts_before]
        if extra:
            at = torch.tensor(extra, dtype=torch.int64, device=device)
            ones = torch.ones(len(extra), device=device)
            counts.index_put_((at[:, 0], at[:, 1]), ones, accumulate=True)
        seen = None
        if any(rows[i].state.prompt_seen is not None for i in pen_rows):
            none = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen = torch.stack([_seen(rows[i].state, none) for i in pen_rows])
        penalties = penalties_for([params[i] for i in pen_rows], pen_rows, counts, seen, device)
    biased = [(i, *r.state.bias) for i, r in enumerate(rows) if r.state.bias is not None]
    return SamplingBatch.make(
        params,
        [r.output_position for r in rows],
        vocab_size,
        device,
        penalties,
        gather_bias(biased, device),
    )


def _counts(state: RequestSampling) -> torch.Tensor:
    assert state.counts is not None
    return state.counts


def _seen(state: RequestSampling, none: torch.Tensor) -> torch.Tensor:
    return none if state.prompt_seen is None else state.prompt_seen
