"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): the logprob of each prompt token
given the tokens before it, with the top-k alternatives, from the raw logits in float32.

A prompt chunk of a request that asked wants logits at its leading positions before the
prompt's last one (`num_prompt_rows`): position p's logits give prompt token p + 1's entry.
The prompt's last position predicts the first output token, so it has no entry, and prompt
token 0 has none either. A chunked prompt yields its entries chunk by chunk, in order; the
scheduler gathers them (services/scheduler/scheduler.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from stoker.common.messages import PromptLogprobs, TokenLogprobs
from stoker.services.worker.request_state import RequestState
from stoker.services.worker.sampler import token_logprobs

# Rows turned into logits at a time: a 2,048-token chunk over a 152k vocabulary would otherwise
# hold 1.2 GB of float32 logits (twice, with the log_softmax).
SLICE_ROWS = 256


def num_prompt_rows(state: RequestState, start: int, end: int) -> int:
    """How many of a chunk's positions [start, end) have a prompt entry to compute: those
    before the prompt's last position; 0 for a request that did not ask."""
    if state.params.prompt_logprobs is None:
        return 0
    return max(0, min(end, state.prompt_len - 1) - start)


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    wanted: list[tuple[RequestState, int, int]],
) -> list[PromptLogprobs]:
    """hidden: the final hidden states of the prompt rows, in `wanted` order; wanted: per chunk,
    (its request, its first position, its number of rows). compute_logits: the model's head."""
    targets, top_n = _targets(wanted)
    entries: list[TokenLogprobs] = []
    for first in range(0, hidden.shape[0], SLICE_ROWS):
        rows = hidden[first : first + SLICE_ROWS]
        entries += token_logprobs(
            compute_logits(rows),
            list(range(rows.shape[0])),
            targets[first : first + SLICE_ROWS],
            top_n[first : first + SLICE_ROWS],
        )
    return _split(entries, wanted)


def null_prompt_logprobs(
    vocab_size: int, wanted: list[tuple[RequestState, int, int]]
) -> list[PromptLogprobs]:
    """The null model has no logits: a uniform distribution, so the pipeline has entries to
    carry (its top ids are the first ids)."""
    lp = -math.log(vocab_size)
    targets, top_n = _targets(wanted)
    entries = [TokenLogprobs(lp, list(range(n)), [lp] * n) for n in top_n]
    return _split(entries, wanted)


def _targets(wanted: list[tuple[RequestState, int, int]]) -> tuple[list[int], list[int]]:
    """Per row, the prompt token its logits predict, and the request's top-k."""
    targets: list[int] = []
    top_n: list[int] = []
    for state, start, n in wanted:
        targets += state.token_ids[start + 1 : start + 1 + n]
        k = state.params.prompt_logprobs
        assert k is not None
        top_n += [k] * n
    return targets, top_n


def _split(
    entries: list[TokenLogprobs], wanted: list[tuple[RequestState, int, int]]
) -> list[PromptLogprobs]:
    out, offset = [], 0
    for state, start, n in wanted:
        out.append(PromptLogprobs(state.req_id, start + 1, entries[offset : offset + n]))
        offset += n
    return out
