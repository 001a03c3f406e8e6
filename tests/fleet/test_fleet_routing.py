"""Two replicas behind smg, measured from the replicas' own /metrics: cache-aware routing
beats round robin on prefix-cache hits; a killed replica is routed around with no failed
request beyond those in flight on it; restarted, it gets traffic again."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import time

import pytest
from openai import AsyncOpenAI

from stoker.tools.fleet.plan import router_command
from stoker.tools.fleet.workload import PrefixCounters, shared_prefix_prompts
from tests.fleet.fleet_procs import (
    MODEL,
    Fleet,
    answers_200,
    free_port_run,
    process_tree,
    start_fleet,
    stop_fleet,
    wait_until,
    workers_healthy,
)

pytestmark = pytest.mark.slow
CONCURRENCY = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = start_fleet(tmp_path_factory.mktemp("fleet"), replicas=2)  # cache_aware, the default
    yield f
    stop_fleet(f)


@pytest.fixture(scope="module")
def round_robin(fleet):
    """A second router, round robin, in front of the same replicas."""
    port = free_port_run(2)
    args = argparse.Namespace(
        host="127.0.0.1", port=port, router_policy="round_robin", router_metrics_port=port + 1,
        shutdown_timeout=1.0, api_key=None, router_args="",
    )  # fmt: skip
    urls = [fleet.replica_url(i) for i in range(len(fleet.replica_ports))]
    proc = subprocess.Popen(router_command(args, urls), start_new_session=True)
    rr = Fleet(proc, port, fleet.replica_ports, port + 1, fleet.run_dir)
    try:
        wait_until(lambda: workers_healthy(rr) == len(urls), 60, "the round-robin router", proc)
        yield rr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


async def _send(
    url: str, prompts: list[str], max_tokens: int = 4, results: list[tuple] | None = None
) -> list[tuple]:
    """(start, end, error or None) per request, CONCURRENCY at a time, appended to `results`
    (a caller's list lets it watch the load's progress) as each ends."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    gate = asyncio.Semaphore(CONCURRENCY)
    results = [] if results is None else results

    async def one(prompt: str) -> None:
        async with gate:
            start = time.monotonic()
            try:
                out = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
                )
                error = None if out.usage.completion_tokens == max_tokens else "short"
            except Exception as e:  # the client's own error, whatever the router answered
                error = repr(e)
            results.append((start, time.monotonic(), error))

    await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    return results


def _hit_rate(fleet: Fleet, router_url: str, seed: int) -> PrefixCounters:
    before = fleet.total()
    # 16 prefixes of about 200 tokens, 4 questions each: a cache-aware router misses each
    # prefix about once, round robin about once per replica.
    results = asyncio.run(_send(router_url, shared_prefix_prompts(16, 4, seed=seed)))
    assert [r for r in results if r[2]] == []
    return fleet.total() - before


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(fleet, round_robin):
    # Different seeds: the two runs share no prefix, so neither warms the other's cache.
    cache_aware = _hit_rate(fleet, fleet.url, seed=101)
    rr = _hit_rate(fleet, round_robin.url, seed=202)
    print(f"prefix hit rate: cache_aware {cache_aware.hit_rate:.3f}, round_robin {rr.hit_rate:.3f}")
    assert cache_aware.queries > 0 and rr.queries > 0
    assert cache_aware.hit_rate > rr.hit_rate + 0.05


def _kill_replica(fleet: Fleet, i: int) -> None:
    """Every process of the replica at once, as when its machine or container goes."""
    for pid in process_tree(fleet.replica_pid(i)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_killed_replica_is_routed_around_and_rejoins_when_restarted(fleet):
    victim = 1
    old_pid = fleet.replica_pid(victim)
    prompts = shared_prefix_prompts(16, 10, seed=303)

    async def load_and_kill() -> tuple[float, list[tuple]]:
        done: list[tuple] = []

        async def killer() -> float:
            # Once a round of requests has finished, whatever the box's speed (a fixed second
            # was longer than the whole load on a fast box), so most of the load comes after.
            deadline = time.monotonic() + 60
            while len(done) < CONCURRENCY and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            _kill_replica(fleet, victim)
            return time.monotonic()

        # Long enough answers that requests are in flight on the victim when it goes.
        killed, results = await asyncio.gather(killer(), _send(fleet.url, prompts, 16, done))
        return killed, results

    killed_at, results = asyncio.run(load_and_kill())
    assert any(start > killed_at for start, _, _ in results), "the load ended before the kill"
    failed = [r for r in results if r[2]]
    in_flight = [r for r in results if r[0] < killed_at < r[1]]
    print(f"replica killed: {len(failed)} of {len(results)} failed, {len(in_flight)} in flight")
    # Only requests in flight at the kill may fail (the front retries them through smg).
    assert all(start < killed_at for start, _, _ in failed), failed
    assert len(failed) <= len(in_flight) <= CONCURRENCY

    # The fleet starts the replica again in its slot; smg's health checks take it back.
    wait_until(lambda: fleet.replica_pid(victim) != old_pid, 30, "the restart", fleet.proc)
    # The replica's own /health first: smg may not have probed the dead one yet, and then it
    # still counts it healthy while the new process is starting.
    up = fleet.replica_url(victim) + "/health"
    wait_until(lambda: answers_200(up), 180, "the restarted replica's /health", fleet.proc)
    wait_until(lambda: workers_healthy(fleet) == 2, 180, "the replica rejoining", fleet.proc)
    before = fleet.counters(victim)
    results = asyncio.run(_send(fleet.url, shared_prefix_prompts(16, 2, seed=404)))
    assert [r for r in results if r[2]] == []
    assert (fleet.counters(victim) - before).queries > 0, "the restarted replica got no traffic"
