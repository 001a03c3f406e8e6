"""The one-shot cost of the KV-event stream (`--kv-events-config`), on the scheduler's side.

A synthetic request stream drives the block manager exactly as the scheduler does (prefix
lookup, slots for prompt + output, blocks keyed as they fill, free at the end) over a pool small
enough to evict, with 8 shared 256-token system prompts. It runs three ways:
- events off: the block manager alone (the scheduler without `--kv-events-config`);
- events recorded: the block manager keeping its event log, drained once per step;
- events published: the same, and each step's events handed to ZmqEventPublisher.publish (the
  in-loop part: building the wire structs and enqueueing) with its thread encoding and sending on
  a real PUB socket to a real SUB subscriber, which counts events and bytes.
It reports the scheduler-loop time per request each way, the publisher thread's CPU time, and
the wire bytes per event, and writes JSON to benchmarks/results/.

    .venv/bin/python benchmarks/kv_events.py [--requests 4000]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zmq  # noqa: E402
from bench_utils import write_result  # noqa: E402

from stoker.services.scheduler.block_manager import BlockManager  # noqa: E402
from stoker.services.scheduler.kv_events import KVEventsConfig, ZmqEventPublisher  # noqa: E402

BLOCK = 16
PROMPT, SHARED, OUTPUT, CONCURRENT = 512, 256, 128, 32


def _requests(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(SHARED)] for _ in range(8)]
    return [
        rng.choice(systems) + [rng.randrange(32000) for _ in range(PROMPT - SHARED + OUTPUT)]
        for _ in range(n)
    ]


def _drive(blocks: BlockManager, requests: list[list[int]], on_step) -> tuple[float, int]:
    """CONCURRENT requests at a time, each a prefill step then OUTPUT // BLOCK decode steps of
    BLOCK tokens (one block filling per step, as 16 decodes would); returns (seconds, steps)."""
    t0 = time.perf_counter()
    steps = 0
    for start in range(0, len(requests), CONCURRENT):
        wave = list(enumerate(requests[start : start + CONCURRENT], start))
        blocks.begin_step()
        for rid, tokens in wave:
            blocks.allocate_prefix(rid, tokens[:PROMPT])
            assert blocks.allocate_slots(rid, PROMPT) is not None
            blocks.cache_blocks(rid, tokens, PROMPT)
        on_step()
        steps += 1
        for done in range(PROMPT + BLOCK, PROMPT + OUTPUT + 1, BLOCK):
            blocks.begin_step()
            for rid, tokens in wave:
                assert blocks.allocate_slots(rid, done) is not None
                blocks.cache_blocks(rid, tokens, done)
            on_step()
            steps += 1
        for rid, _ in wave:
            blocks.free(rid)
    return time.perf_counter() - t0, steps


def _pool() -> int:
    # Room for the running wave and about 4 waves' worth of cached blocks: evictions happen.
    return CONCURRENT * (PROMPT + OUTPUT) // BLOCK * 5


def run(num_requests: int) -> dict:
    requests = _requests(num_requests)
    off_s, steps = _drive(BlockManager(_pool(), BLOCK), requests, lambda: None)

    recorded = BlockManager(_pool(), BLOCK, record_events=True)
    drained: list[int] = [0]

    def drain() -> None:
        drained[0] += len(recorded.take_events())

    rec_s, _ = _drive(recorded, requests, drain)

    endpoint = "ipc:///tmp/stoker-kv-events-bench"
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
    )
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the PUB socket before anything is sent
    got = {"batches": 0, "bytes": 0}

    def receive() -> None:
        while True:
            if not sub.poll(2000):
                return
            frames = sub.recv_multipart()
            got["batches"] += 1
            got["bytes"] += sum(len(f) for f in frames)

    receiver = threading.Thread(target=receive)
    receiver.start()
    published = BlockManager(_pool(), BLOCK, record_events=True)
    num_events = [0]

    def publish() -> None:
        events = published.take_events()
        num_events[0] += len(events)
        publisher.publish(events)

    thread_cpu0 = time.thread_time()  # this thread's; the publisher thread's is below
    pub_s, _ = _drive(published, requests, publish)
    main_cpu = time.thread_time() - thread_cpu0
    publisher.close(timeout=10.0)
    receiver.join()
    sub.close(linger=0)
    ctx.term()
    per_request = 1e6 / num_requests
    return {
        "requests": num_requests,
        "steps": steps,
        "workload": {"prompt": PROMPT, "shared_prefix": SHARED, "output": OUTPUT,
                     "concurrent": CONCURRENT, "block_size": BLOCK, "pool_blocks": _pool()},
        "events_per_request": num_events[0] / num_requests,
        "loop_us_per_request": {
            "off": off_s * per_request,
            "recorded": rec_s * per_request,
            "published": pub_s * per_request,
        },
        "publish_overhead_us_per_step": (pub_s - off_s) * 1e6 / steps,
        "main_thread_cpu_s": main_cpu,
        "dropped_batches": publisher.dropped,
        "received_batches": got["batches"],
        "wire_bytes": got["bytes"],
        "wire_bytes_per_event": got["bytes"] / max(1, num_events[0]),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    result = run(parser.parse_args().requests)
    path = write_result("kv_events", result)
    loop = result["loop_us_per_request"]
    print(
        f"{result['requests']} requests, {result['events_per_request']:.1f} events each: "
        f"block manager {loop['off']:.1f} us/request without events, {loop['recorded']:.1f} "
        f"recording, {loop['published']:.1f} publishing "
        f"({result['publish_overhead_us_per_step']:.1f} us per step over {result['steps']} "
        f"steps); {result['wire_bytes_per_event']:.0f} wire bytes per event; received "
        f"{result['received_batches']} batches, dropped {result['dropped_batches']} -> {path}"
    )


if __name__ == "__main__":
    main()
