"""Overload is shed, not absorbed: past --max-queued-requests new requests get 503 with
Retry-After while the admitted ones are served; --request-timeout-s ends a request with an
error and frees its blocks; a 2,000-request burst leaves memory bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.reliability.serve import Served, stream_events

BODY = {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True}
MAX_QUEUED = 6


@pytest.fixture(scope="module")
def shedding(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shed")
    flags = ["--null-model", "--max-queued-requests", str(MAX_QUEUED)]
    server = Served(model, tmp / "run", tmp / "serve.log", *flags)
    yield server
    server.stop()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_flood_past_the_queue_bound_is_shed_and_admitted_requests_finish(shedding):
    """The worker is frozen so nothing leaves the queue: exactly MAX_QUEUED requests are
    admitted, every other one is a 503 with Retry-After; once it thaws, the admitted finish."""
    (worker,) = shedding.child("worker")
    url = f"{shedding.url}/v1/completions"
    pool = ThreadPoolExecutor(MAX_QUEUED)
    os.kill(worker, signal.SIGSTOP)
    try:
        admitted = [pool.submit(httpx.post, url, json=BODY, timeout=60) for _ in range(MAX_QUEUED)]
        _wait_for(lambda: shedding.state()["api_waiting"] == MAX_QUEUED)
        shed = [httpx.post(url, json=BODY, timeout=10) for _ in range(20)]
        for r in shed:
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
        r = httpx.post(url, json={**BODY, "n": 2}, timeout=10)  # n sub-requests need n places
        assert r.status_code == 503
    finally:
        os.kill(worker, signal.SIGCONT)
    for f in admitted:
        r = f.result()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    pool.shutdown()
    r = httpx.post(url, json=BODY, timeout=30)  # room again
    assert r.status_code == 200
    s = shedding.wait_blocks_free()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert shedding.state()["api_waiting"] == 0


@pytest.fixture(scope="module")
def deadline_server(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deadline")
    flags = ["--null-model", "--request-timeout-s", "1.5"]
    server = Served(model, tmp / "run", tmp / "serve.log", *flags)
    yield server
    server.stop()


def test_request_timeout_ends_requests_with_an_error_and_frees_blocks(deadline_server):
    server = deadline_server
    (worker,) = server.child("worker")
    url = f"{server.url}/v1/completions"
    os.kill(worker, signal.SIGSTOP)  # nothing finishes: every request reaches its deadline
    try:
        r = httpx.post(url, json=BODY, timeout=30)
        assert r.status_code == 504, r.text
        assert "--request-timeout-s" in r.json()["error"]["message"]
        with httpx.Client() as client:  # streaming: no token yet, so still a JSON 504
            events = stream_events(client, url, BODY)
        assert events[0][:2] == ("status", 504)
    finally:
        os.kill(worker, signal.SIGCONT)
    s = server.wait_blocks_free()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert server.state()["api_inflight"] == 0


def test_request_timeout_mid_stream_is_an_error_event_then_done(deadline_server):
    server = deadline_server
    (worker,) = server.child("worker")
    body = {"prompt": [5, 6, 7], "max_tokens": 48, "ignore_eos": True}

    def freeze() -> None:
        os.kill(worker, signal.SIGSTOP)

    try:
        with httpx.Client() as client:
            events = stream_events(client, f"{server.url}/v1/completions", body, on_first=freeze)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    # The stream either finished before the freeze took hold, or ended with the deadline.
    if errors:
        assert "--request-timeout-s" in errors[0]["error"]["message"]
    else:
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    s = server.wait_blocks_free()
    assert s["num_free_blocks"] == s["num_total_blocks"]


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


RSS_GROWTH_BOUND_MB = 200  # all services together, for a 2,000-request burst


@pytest.mark.slow
def test_a_2000_request_burst_keeps_memory_bounded(model, tmp_path):
    flags = ["--null-model", "--max-queued-requests", "256"]
    server = Served(model, tmp_path / "run", tmp_path / "serve.log", *flags)
    try:
        pids = server.children
        before = sum(_rss_kb(p) for p in pids)

        async def burst() -> list[int]:
            limits = httpx.Limits(max_connections=2000)
            async with httpx.AsyncClient(limits=limits, timeout=120) as client:

                async def one() -> int:
                    body = {"prompt": "hello " * 20, "max_tokens": 16}
                    return (
                        await client.post(f"{server.url}/v1/completions", json=body)
                    ).status_code

                return await asyncio.gather(*(one() for _ in range(2000)))

        statuses = asyncio.run(burst())
        assert set(statuses) <= {200, 503} and 200 in statuses
        after = sum(_rss_kb(p) for p in pids)
        assert (after - before) / 1024 < RSS_GROWTH_BOUND_MB, (before, after)
        s = server.wait_blocks_free(timeout=30)
        assert s["num_free_blocks"] == s["num_total_blocks"]
    finally:
        server.stop()
