"""Tensor parallelism on this box: TP=2 against TP=1 (offline tokens/s), the time rank 0 spends
in collectives per step, and the two ways of handing a plan to the other ranks (a gloo
broadcast, or a ZeroMQ socket each: what stoker uses, as it measured cheaper), measured between
two processes.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/tensor_parallel.py [--model PATH]

Writes benchmarks/results/tensor_parallel-*.json. On a 2-core CPU box, two ranks share the
cores that one rank had (one thread each), so TP=2 is not expected to be faster here: the
point is the cost of the collectives and of the plan hand-off. On GPUs each rank has its own
device and the same code runs over NCCL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_utils import bench_model, random_prompts, write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _Timed:
    """Wraps one communicator method on rank 0, summing its wall time."""

    def __init__(self, comm, name: str) -> None:  # noqa: ANN001
        self.fn, self.seconds, self.calls = getattr(comm, name), 0.0, 0
        setattr(comm, name, self)

    def __call__(self, *args):  # noqa: ANN002, ANN204
        t = time.perf_counter()
        out = self.fn(*args)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


def run_engine(model: str, tp: int, prompts, max_tokens: int, max_num_seqs: int) -> dict:
    from stoker.services.engine import LLM, SamplingParams

    llm = LLM(
        model,
        tensor_parallel_size=tp,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=max(64, len(prompts) * (len(prompts[0]) + max_tokens) // 16 + 8),
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    timers = {}
    if tp > 1:
        ranks = llm.engine.ranks
        timers = {n: _Timed(ranks.comm, n) for n in ("all_reduce", "all_gather_last")}
        timers["plan_send"] = _Timed(ranks.plans, "send")
    steps = 0
    step = llm.engine.step

    def counted():  # noqa: ANN202
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counted
    t = time.perf_counter()
    out = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in out)
    llm.close()
    result = {
        "tensor_parallel_size": tp,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "steps": steps,
        "step_ms": round(1e3 * wall / steps, 2),
    }
    for name, timer in timers.items():
        result[f"{name}_ms_per_step"] = round(1e3 * timer.seconds / steps, 3)
        result[f"{name}_calls_per_step"] = round(timer.calls / steps, 1)
    return result


# -- plan hand-off and all-reduce between two bare processes ------------------------------------


def _pair(rank: int, port: int, sizes: list[int], hidden: int, rows: list[int], queue) -> None:  # noqa: ANN001
    import numpy as np
    import torch
    import torch.distributed as dist
    import zmq

    from stoker.services.worker.parallel.comm import Communicator
    from stoker.services.worker.parallel.plan_channel import PlanChannel

    torch.set_num_threads(1)
    comm = Communicator(rank, 2, torch.device("cpu"), "127.0.0.1", port)
    plans = PlanChannel(comm, "127.0.0.1", single_node=True)
    reps = 300
    out: dict = {"plan_gloo_us": {}, "plan_zmq_us": {}, "all_reduce_us": {}}
    ctx = zmq.Context()
    acks = ctx.socket(zmq.PUSH if rank else zmq.PULL)  # the ZeroMQ round trip's way back
    if rank == 0:
        acks.bind(f"tcp://127.0.0.1:{port + 1}")
    else:
        acks.connect(f"tcp://127.0.0.1:{port + 1}")
    comm.barrier()
    ack = torch.zeros(1, dtype=torch.int64)
    for size in sizes:
        payload = np.random.bytes(size)
        buf = torch.zeros(size, dtype=torch.uint8)
        # Round trips (plan out, 8-byte ack back); one way is half.
        for label in ("plan_gloo_us", "plan_zmq_us"):
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                if label == "plan_gloo_us":
                    if rank == 0:
                        buf.numpy()[:] = np.frombuffer(payload, np.uint8)
                    dist.broadcast(buf, src=0, group=comm.control)
                    if rank:
                        buf.numpy().tobytes()
                    dist.broadcast(ack, src=1, group=comm.control)
                elif rank == 0:
                    plans.send(payload)
                    acks.recv()
                else:
                    plans.recv()
                    acks.send(b"ack")
                times.append(time.perf_counter() - t)
            out[label][size] = round(1e6 * statistics.median(times) / 2, 1)
    for n in rows:
        x = torch.randn(n, hidden)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            comm.all_reduce(x)
            times.append(time.perf_counter() - t)
        out["all_reduce_us"][n] = round(1e6 * statistics.median(times), 1)
    acks.close(0)
    ctx.term()
    plans.close()
    comm.close()
    if rank == 0:
        queue.put(out)


def run_pair(hidden: int) -> dict:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    sizes, rows = [256, 4096, 12288], [1, 16, 256]
    procs = [ctx.Process(target=_pair, args=(r, port, sizes, hidden, rows, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = queue.get(timeout=600)
    for p in procs:
        p.join()
    out["hidden"] = hidden
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the 12-layer d768 bench Llama")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(bench_model())
    from stoker.common.model_config import ModelConfig

    cfg = ModelConfig.from_folder(model)
    prompts = random_prompts(args.prompts, args.prompt_len, args.prompt_len, cfg.vocab_size)
    runs = [run_engine(model, tp, prompts, args.max_tokens, args.prompts) for tp in (1, 2)]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": os.path.basename(model.rstrip("/")),
        "cpus": os.cpu_count(),
        "load_avg_before": os.getloadavg(),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "two_process_microbench": run_pair(cfg.hidden_size),
        "note": "shared 2-core box with other agents' jobs running: noisy",
    }
    print(result)
    print(write_result("tensor_parallel", result))


if __name__ == "__main__":
    main()
