"""The scheduler's host cost per step, without sockets: the core's `schedule()` and `update()`
and the service's per-step encoding (plan encode, token batches), timed at N running requests
in steady decode.

A fake worker answers every plan with one token per request, so this measures only what the
scheduler process spends per step, the part the issue's "scheduler step p50" names. Overlap
scheduling is reproduced (two plans in flight), as the service runs it.

    .venv/bin/python benchmarks/scheduler_step.py --running 256 --steps 2000
    .venv/bin/python benchmarks/scheduler_step.py --running 256 --cold-mib 8   # caches cold
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import p50_p99_us, steady_decode_args, write_result  # noqa: E402

from stoker.common.ipc import encoder  # noqa: E402
from stoker.common.messages import StepPlan, StepResult, TokenBatch, pack_ids  # noqa: E402
from stoker.common.sampling_params import SamplingParams  # noqa: E402
from stoker.services.scheduler.block_manager import BlockManager  # noqa: E402
from stoker.services.scheduler.request import Request  # noqa: E402
from stoker.services.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402


def _fake_result(plan: StepPlan, token: int) -> StepResult:
    """One sampled token for each request whose known tokens this step reaches (all, in decode)."""
    ids = [n.req_id for n in plan.new_requests] + plan.running.req_ids
    return StepResult(step_id=plan.step_id, req_ids=ids, token_ids=pack_ids([token] * len(ids)))


def _publish_cost(updates) -> None:
    """Building and encoding a steady decode step's TokenBatch (every row steady: two columns,
    ids and packed tokens). The service's per-row checks and owner lookups are not in it."""
    ids, tokens = [u.req_id for u in updates], [u.new_token_ids[0] for u in updates]
    encoder.encode(TokenBatch([], ids, pack_ids(tokens)))


def run(num_running: int, steps: int, prompt_len: int, block_size: int, cold_mib: int = 0) -> dict:
    # In the server, other processes run between two of the scheduler's steps and evict its
    # requests from L1/L2: cold_mib > 0 reproduces that by touching a buffer before each step.
    junk = np.zeros(cold_mib << 20, dtype=np.uint8)
    num_blocks = num_running * ((prompt_len + steps + 80) // block_size + 3)
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=max(2048, num_running),
            max_model_len=prompt_len + block_size + steps + 80,
        ),
        blocks,
    )
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_running):
        # Lengths spread over a block, so block boundaries fall on different steps.
        prompt = [(i * 7919 + j) % 30000 + 1 for j in range(prompt_len + i % block_size)]
        sched.add_request(Request(f"req-{i}", prompt, params, steps + 64, (2,)))
    inflight: collections.deque[StepPlan] = collections.deque()
    # Prefill until every request decodes, then measure steady decode.
    while len(sched.running) < num_running or any(r.num_output_tokens == 0 for r in sched.running):
        inflight.append(sched.schedule())
        plan = inflight.popleft()
        sched.update(plan, _fake_result(plan, 5))
    t_schedule, t_encode, t_update, t_publish = [], [], [], []
    for step in range(steps):
        if cold_mib:
            junk[::64] += 1  # one write per cache line
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        encoder.encode(plan)
        t2 = time.perf_counter()
        inflight.append(plan)
        if len(inflight) < 2:
            t_schedule.append(t1 - t0)
            t_encode.append(t2 - t1)
            continue
        done = inflight.popleft()
        result = _fake_result(done, 5 + step % 1000)
        t3 = time.perf_counter()
        updates = sched.update(done, result)
        t4 = time.perf_counter()
        _publish_cost(updates)
        t5 = time.perf_counter()
        assert len(done.running.req_ids) == num_running, "left steady decode"
        t_schedule.append(t1 - t0)
        t_encode.append(t2 - t1)
        t_update.append(t4 - t3)
        t_publish.append(t5 - t4)

    return {
        "running": num_running,
        "steps": steps,
        "cold_mib": cold_mib,
        "schedule": p50_p99_us(t_schedule),
        "plan_encode": p50_p99_us(t_encode),
        "update": p50_p99_us(t_update),
        "publish": p50_p99_us(t_publish),
    }


def main() -> None:
    args = steady_decode_args(__doc__, cold=True)
    results = [
        run(n, args.steps, args.prompt_len, args.block_size, args.cold_mib) for n in args.running
    ]
    for r in results:
        print(
            f"{r['running']:4d} running: schedule p50 {r['schedule']['p50_us']:7.1f} us "
            f"(p99 {r['schedule']['p99_us']:7.1f}), plan encode {r['plan_encode']['p50_us']:6.1f}, "
            f"update {r['update']['p50_us']:7.1f} (p99 {r['update']['p99_us']:7.1f}), "
            f"publish {r['publish']['p50_us']:6.1f}"
        )
    print("wrote", write_result("scheduler_step", {"results": results}))


if __name__ == "__main__":
    main()
