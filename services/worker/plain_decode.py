"""The worker's steady-decode fast path, "plain decode" (docs/steady-decode.md, the execute
stage), beside the general path (`ModelRunner.execute`) it short-cuts.

The worker checks its part of a steady row: a running request scheduled exactly one token, with
no speculative ids and no proposals asked (speculation may be configured and idle), whose known
tokens end one past its computed ones, so the token it computes is its last sampled one and the
step samples the next (a one-token prompt chunk samples nothing and is not steady). The row may
take new blocks, as a stop row does. A plain decode step is one whose rows are all steady, whose
plan brings no new request, and whose proposer (if any) taps no target layer: an EAGLE head
records every eager forward's features, which only the general path hands it. Unlike the
scheduler's stages the worker serves logprobs and every sampling option here: the path changes
the layout, not the result.

That is nearly every step at high concurrency. Its rows come from per-request arrays (token,
position, block-table row) rather than Scheduled and Chunk objects; tests/worker/
test_plain_decode.py compares it with the general path step for step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from stoker.common.messages import StepPlan, StepResult, TokenLogprobs, pack_ids
from stoker.common.profiling import span
from stoker.services.worker.host_copy import host_list
from stoker.services.worker.proposer import Proposer
from stoker.services.worker.request_state import RequestState, null_next_token
from stoker.services.worker.sampling_state import Row, batch_for
from stoker.services.worker.step_inputs import build_decode_inputs
from stoker.services.worker.step_sampling import request_logprobs

if TYPE_CHECKING:  # the runner imports this module
    from stoker.services.worker.model_runner import ModelRunner


def steady_states(
    plan: StepPlan, requests: dict[str, RequestState], proposer: Proposer | None
) -> list[RequestState] | None:
    """The running requests' states where this step is a plain decode; None: any other step,
    which takes the general path. Reads state, changes none."""
    running = plan.running
    req_ids = running.req_ids
    if (
        plan.new_requests
        or not req_ids
        or any(running.spec_token_ids)  # [b"", ...] when speculation is on but idle
        or any(running.num_spec_tokens)
        or (proposer is not None and proposer.tap_layers)
        or running.num_scheduled_tokens.count(1) != len(req_ids)
    ):
        return None
    states = [requests[r] for r in req_ids]
    if any(len(s.token_ids) != s.num_computed + 1 for s in states):
        return None  # a one-token prompt chunk, which samples nothing
    return states


def execute_plain_decode(
    runner: ModelRunner, plan: StepPlan, states: list[RequestState], t0: float
) -> StepResult:
    """runner.execute() for a plain decode step: the general path's result, from arrays."""
    running, table = plan.running, runner.block_table
    for i, blocks in enumerate(running.new_block_ids):
        if blocks:
            state = states[i]
            state.block_ids.extend(blocks)
            table.append(state.table_row, blocks)
    n = len(states)
    ids = np.fromiter((s.token_ids[-1] for s in states), np.int64, n)
    positions = np.fromiter((s.num_computed for s in states), np.int64, n)
    rows = np.fromiter((s.table_row for s in states), np.int64, n)
    masks = None
    if any(s.params.structured is not None for s in states):
        structured = [(s.req_id, i, []) for i, s in enumerate(states) if s.params.structured]
        masks = runner.grammars.begin(structured, n)  # worker/grammar.py: where they fill
    t1 = time.perf_counter()
    logits = greedy_ids = None
    if runner.model is not None:
        graphs = runner.graphs
        widths = table.widths(rows)
        if graphs is not None and not graphs.accepts_rows(widths):
            graphs = None
        inputs = None
        if graphs is not None:
            graphs.prepare_rows(ids, positions, table.table[rows, : graphs.width])
        else:
            tables = table.table[rows, : int(widths.max())]
            inputs = build_decode_inputs(ids, positions, tables, runner.block_size, runner.device)
        argmax_only = all(s.sampling.argmax_only for s in states)
        runner.forward_timer.start()
        with span("forward"):
            logits, greedy_ids = runner.forward(graphs, inputs, None, n, argmax_only, masks)
        runner.forward_timer.stop()
    t2 = time.perf_counter()
    logprobs: list[TokenLogprobs | None] | None = None
    with span("sample"):
        if runner.model is None:
            tokens = null_next_token(ids, runner.model_cfg.vocab_size).tolist()
            if masks is not None:
                tokens = masks.choose(tokens)
        elif greedy_ids is not None:
            tokens = host_list(greedy_ids)
        else:
            assert logits is not None
            if masks is not None:
                masks.apply(logits)
            rows_ = [Row(s.sampling, len(s.token_ids) - s.prompt_len) for s in states]
            batch = batch_for(rows_, runner.model_cfg.vocab_size, runner.device)
            tokens = host_list(runner.sampler(logits, batch).token_ids)
            if any(s.params.logprobs is not None for s in states):
                lists = [[t] for t in tokens]
                per_request = request_logprobs(states, list(range(n)), lists, logits)
                logprobs = [None if lp is None else lp[0] for lp in per_request]
    for state, token in zip(states, tokens):
        state.num_computed += 1
        state.token_ids.append(token)
        if state.sampling.counts is not None:
            state.sampling.add((token,))
    forced_ids, forced_tokens = [], []  # as in ModelRunner.execute
    if masks is not None:
        structured = [(s.req_id, (t,)) for s, t in zip(states, tokens) if s.params.structured]
        forced_ids, forced_tokens = runner.grammars.advance(structured)
    t3 = time.perf_counter()
    forward_host_s = t2 - t1
    forward_s = 0.0 if runner.model is None else runner.forward_timer.device_seconds(forward_host_s)
    return StepResult(
        step_id=plan.step_id,
        req_ids=running.req_ids,
        token_ids=pack_ids(tokens),
        logprobs=logprobs,
        prepare_s=t1 - t0,
        forward_s=forward_s,
        sample_s=t3 - t2,
        forward_host_s=forward_host_s,
        num_tokens=n,
        num_reqs=n,
        forced_req_ids=forced_ids,
        forced_token_ids=forced_tokens,
        grammar_mask_s=0.0 if masks is None else masks.fill_s,
        grammar_wait_s=0.0 if masks is None else masks.wait_s,
    )
