"""Warm the worker up before it reports ready, so the first real request is not the slow one.

A first forward pays one-time costs: oneDNN picks and caches kernels per shape, the allocator
grows its pools, the native kernels fault their code in. One throwaway request (a prompt chunk,
then decodes) pays them before `/health` turns green. Its K/V goes to the scratch block that
padded CUDA-graph rows write to, which the scheduler never hands out, so no real block is
touched, and it is dropped from the runner before the first real plan.
"""

from __future__ import annotations

import logging
import time

from stoker.common.messages import NewRequestData, RunningRequestData, StepPlan, pack_ids
from stoker.common.sampling_params import SamplingParams

log = logging.getLogger("stoker.worker")
WARMUP_ID = "__stoker_warmup__"
PROMPT_TOKENS = 32
DECODE_STEPS = 2


def warm_up(runner) -> float:  # noqa: ANN001 - a ModelRunner (imported lazily by callers)
    """Run a throwaway prefill and decodes; returns the seconds it took."""
    if runner.model is None:
        return 0.0
    start = time.perf_counter()
    scratch = runner.num_blocks  # one block past the scheduler's pool
    blocks_needed = (PROMPT_TOKENS + DECODE_STEPS + runner.block_size - 1) // runner.block_size
    prompt = [(7 * i + 3) % runner.model_cfg.vocab_size for i in range(PROMPT_TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    new = NewRequestData(
        WARMUP_ID, pack_ids(prompt), pack_ids([]), params, [scratch] * blocks_needed, 0,
        PROMPT_TOKENS,
    )  # fmt: skip
    runner.execute(StepPlan(-1, [new], RunningRequestData(), []))
    for step in range(DECODE_STEPS):
        running = RunningRequestData([WARMUP_ID], [1], [[]])
        runner.execute(StepPlan(-2 - step, [], running, []))
    runner.execute(StepPlan(-9, [], RunningRequestData(), [WARMUP_ID]))
    took = time.perf_counter() - start
    log.info(
        "warm-up: one %d-token prefill and %d decodes in %.2f s", PROMPT_TOKENS, DECODE_STEPS, took
    )
    return took
