"""The worker's host cost per step, without sockets or a model: plan decode, `execute()` on the
null model (plan bookkeeping, step inputs, token bookkeeping, result building) and result
encode, timed at N running requests in steady decode.

The plans come from the real scheduler, round-tripped through msgpack as the service sends them,
so block boundaries and finished requests arrive as they do in `stoker serve --null-model`. This
is the worker's share of the host pipeline (`serving.py null`), and on a GPU the part of a decode
step that is not kernels.

    .venv/bin/python benchmarks/worker_step.py --running 256 --steps 2000
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import bench_model, p50_p99_us, steady_decode_args, write_result  # noqa: E402

from stoker.common.config import EngineConfig  # noqa: E402
from stoker.common.ipc import encoder, plan_decoder, worker_outbound_decoder  # noqa: E402
from stoker.common.sampling_params import SamplingParams  # noqa: E402
from stoker.services.scheduler.block_manager import BlockManager  # noqa: E402
from stoker.services.scheduler.request import Request  # noqa: E402
from stoker.services.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from stoker.services.worker.model_runner import ModelRunner  # noqa: E402


def run(model: Path, num_running: int, steps: int, prompt_len: int, block_size: int) -> dict:
    max_len = prompt_len + block_size + steps + 80
    num_blocks = num_running * (max_len // block_size + 3)
    runner = ModelRunner(
        EngineConfig(
            model=str(model), null_model=True, num_kv_blocks=num_blocks, block_size=block_size,
            max_num_seqs=num_running, max_model_len=max_len,
        )
    )  # fmt: skip
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=max(2048, num_running),
            max_model_len=max_len,
        ),
        BlockManager(num_blocks, block_size),
    )
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_running):
        # Lengths spread over a block, so block boundaries fall on different steps.
        prompt = [(i * 7919 + j) % 30000 + 1 for j in range(prompt_len + i % block_size)]
        sched.add_request(Request(f"req-{i}", prompt, params, steps + 64, (2,)))

    def step() -> tuple[float, float, float, int]:
        plan = sched.schedule()
        raw = encoder.encode(plan)
        t0 = time.perf_counter()
        decoded = plan_decoder.decode(raw)
        t1 = time.perf_counter()
        result = runner.execute(decoded)
        t2 = time.perf_counter()
        out = encoder.encode(result)
        t3 = time.perf_counter()
        sched.update(plan, worker_outbound_decoder.decode(out))
        return t1 - t0, t2 - t1, t3 - t2, len(plan.running.req_ids)

    while len(sched.running) < num_running or any(r.num_output_tokens == 0 for r in sched.running):
        step()
    t_decode, t_execute, t_encode = [], [], []
    for _ in range(steps):
        d, e, c, running = step()
        assert running == num_running, "left steady decode"
        t_decode.append(d)
        t_execute.append(e)
        t_encode.append(c)

    return {
        "running": num_running,
        "steps": steps,
        "plan_decode": p50_p99_us(t_decode),
        "execute": p50_p99_us(t_execute),
        "result_encode": p50_p99_us(t_encode),
    }


def main() -> None:
    args = steady_decode_args(__doc__)
    model = bench_model()
    results = [run(model, n, args.steps, args.prompt_len, args.block_size) for n in args.running]
    for r in results:
        e = r["execute"]
        print(
            f"{r['running']:4d} running: plan decode p50 {r['plan_decode']['p50_us']:6.1f} us, "
            f"execute p50 {e['p50_us']:7.1f} (p99 {e['p99_us']:7.1f}, "
            f"{e['p50_us'] / r['running']:.2f} us a request), "
            f"result encode {r['result_encode']['p50_us']:6.1f}"
        )
    print("wrote", write_result("worker_step", {"results": results}))


if __name__ == "__main__":
    main()
