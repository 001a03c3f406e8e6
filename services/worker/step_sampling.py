"""A step's sampled rows to tokens: plain rows through the Sampler, verify rows through
spec_verify (rejection sampling, docs/speculation.md), the greedy head's tokens where every row
wants only the argmax, and the logprobs of the requests that asked."""

from __future__ import annotations

import torch

from stoker.common.messages import TokenLogprobs
from stoker.services.worker.grammar import StepMasks
from stoker.services.worker.host_copy import host_list
from stoker.services.worker.request_state import RequestState, Scheduled, null_next_token
from stoker.services.worker.sampler import Sampler, token_logprobs
from stoker.services.worker.sampling_state import Row, batch_for
from stoker.services.worker.spec_verify import VerifyGroup, accept_equal, verify
from stoker.services.worker.step_inputs import Chunk

# Per sampled request: its new tokens, and their logprobs where it asked.
Output = tuple[list[int], list[TokenLogprobs] | None]


def null_outputs(
    sampled: list[Scheduled],
    vocab_size: int,
    masks: StepMasks | None = None,
    ranges: list[tuple[int, int]] | None = None,
    chunks: list[Chunk] | None = None,
) -> list[Output]:
    """The null model's tokens; under a grammar, the first allowed one where its own is not."""
    tokens = [null_next_token(i.state.token_ids[-1], vocab_size) for i in sampled]
    if masks is not None:
        assert ranges is not None and chunks is not None
        firsts = [first for (first, _), c in zip(ranges, chunks) if c.num_sampled]
        by_row = masks.choose(_rows_of(tokens, firsts))
        tokens = [by_row[first] for first in firsts]
    return [([t], None) for t in tokens]


def _rows_of(tokens: list[int], firsts: list[int]) -> list[int]:
    """Per logits row, the token of the request whose first row it is (0 elsewhere)."""
    out = [0] * (max(firsts) + 1)
    for t, first in zip(tokens, firsts):
        out[first] = t
    return out


def sample_outputs(
    sampler: Sampler,
    sampled: list[Scheduled],
    logits: torch.Tensor,
    ranges: list[tuple[int, int]],
    chunks: list[Chunk],
    vocab_size: int,
    device: torch.device,
) -> list[Output]:
    """ranges: per chunk, its rows in the logits; sampled: the chunks' requests that sample."""
    if not sampled:
        return []
    ranges = [r for r, c in zip(ranges, chunks) if c.num_sampled]
    rows: list[Row] = []
    groups: list[VerifyGroup] = []
    for item, (first, last) in zip(sampled, ranges):
        state = item.state
        num_output = len(state.token_ids) - state.prompt_len
        for j in range(last - first):  # verify rows see the drafts before them as output
            rows.append(Row(state.sampling, num_output + j, item.drafts[:j]))
        if item.k:
            groups.append(
                VerifyGroup(
                    first,
                    item.drafts,
                    item.draft_probs,
                    state.params.greedy,
                    state.params.seed,
                    num_output,
                )
            )
    batch = batch_for(rows, vocab_size, device)
    if not groups:
        tokens = [[t] for t in host_list(sampler(logits, batch).token_ids)]
    else:
        verified = iter(verify(logits, batch, groups, sampler.generator))
        plain = host_list(sampler(logits, batch).token_ids) if len(groups) < len(sampled) else []
        tokens = [
            next(verified) if item.k else [plain[first]]
            for item, (first, _) in zip(sampled, ranges)
        ]
    states = [item.state for item in sampled]
    firsts = [first for first, _ in ranges]
    return list(zip(tokens, request_logprobs(states, firsts, tokens, logits)))


def greedy_outputs(
    sampled: list[Scheduled],
    ranges: list[tuple[int, int]],
    chunks: list[Chunk],
    greedy_ids: torch.Tensor,
) -> list[Output]:
    """sample_outputs' result from the greedy head's tokens: a plain row's token, or a verify's
    drafts up to the first that differs from the target's argmax, then that argmax."""
    ids = host_list(greedy_ids)
    ranges = [r for r, c in zip(ranges, chunks) if c.num_sampled]
    return [
        (accept_equal(item.drafts, ids[first:last]) if item.k else [ids[first]], None)
        for item, (first, last) in zip(sampled, ranges)
    ]


def request_logprobs(
    states: list[RequestState],
    firsts: list[int],
    tokens: list[list[int]],
    logits: torch.Tensor,
) -> list[list[TokenLogprobs] | None]:
    """Per request, its tokens' logprobs if it asked: one pass over the rows that asked.
    firsts: each request's first row in the logits."""
    asked = [i for i, state in enumerate(states) if state.params.logprobs is not None]
    out: list[list[TokenLogprobs] | None] = [None] * len(states)
    if not asked:
        return out
    rows, ids, top_n = [], [], []
    for i in asked:
        first = firsts[i]
        rows.extend(range(first, first + len(tokens[i])))
        ids.extend(tokens[i])
        top_n.extend([states[i].params.logprobs] * len(tokens[i]))
    flat = iter(token_logprobs(logits, rows, ids, top_n))
    for i in asked:
        out[i] = [next(flat) for _ in tokens[i]]
    return out
