"""Many streams at once over two tokenizer processes; streams cut at random points free their
KV blocks promptly."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from stoker.common.sampling_params import SamplingParams

NUM_STREAMS = 64
NUM_CUTS = 20


def _tokenizer_counts(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        if family.name == "stoker:tokenizer_requests":
            return {s.labels["tokenizer"]: s.value for s in family.samples}
    return {}


async def _stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, str | None]:
    text, finish = "", None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in msgspec.json.decode(line[6:])["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
    return text, finish


def test_concurrent_streams_over_two_tokenizers(server, llm):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(16)]
    max_tokens = [rng.randrange(4, 24) for _ in range(NUM_STREAMS)]
    jobs = [(prompts[i % len(prompts)], max_tokens[i]) for i in range(NUM_STREAMS)]
    refs = llm.generate(
        [p for p, _ in jobs], [SamplingParams(temperature=0, max_tokens=m) for _, m in jobs]
    )
    before = _tokenizer_counts(server)

    async def run() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(
                *[
                    _stream_text(
                        client, {"prompt": p, "max_tokens": m, "temperature": 0, "stream": True}
                    )
                    for p, m in jobs
                ]
            )

    results = asyncio.run(run())
    for (text, finish), ref in zip(results, refs):
        assert text == ref.text
        assert finish == ref.finish_reason

    # Counts arrive with tokenizer heartbeats (every 0.5 s): wait for the ones covering the run.
    deadline = time.monotonic() + 5
    while True:
        after = _tokenizer_counts(server)
        served = {k: after[k] - before.get(k, 0) for k in after}
        if sum(served.values()) >= NUM_STREAMS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(served) == 2, after
    assert all(n > 0 for n in served.values()), served  # both tokenizers took requests
    assert sum(served.values()) >= NUM_STREAMS


def test_cut_streams_free_their_blocks(server):
    rng = random.Random(2)
    body = {"prompt": [7, 8, 9, 10], "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def cut(client: httpx.AsyncClient, i: int) -> None:
        if i % 5 == 0:  # some are cut before the response headers even arrive
            try:
                await asyncio.wait_for(_stream_text(client, body), timeout=rng.uniform(0, 0.05))
            except TimeoutError:
                return
            raise AssertionError("a 400-token stream finished within 50 ms")
        n_events = rng.randrange(0, 30)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= n_events:
                    break  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await asyncio.gather(*[cut(client, i) for i in range(NUM_CUTS)])

    asyncio.run(run())
    last_cut = time.monotonic()
    # Blocks must be freed, not within a wall-clock bound: under load the chain (disconnect,
    # abort, scheduler, stats) can take seconds. How long it took is in the failure message.
    state = server.wait_idle(timeout=10.0)
    took = time.monotonic() - last_cut
    assert state["num_running"] == 0 and state["num_waiting"] == 0, (state, took)
    assert state["num_free_blocks"] == state["num_total_blocks"], (state, took)
    assert httpx.get(f"{server.url}/debug/state", timeout=5).json()["api_inflight"] == 0


def test_non_streaming_client_that_leaves_is_aborted(server):
    body = {"prompt": [11, 12, 13], "max_tokens": 480, "ignore_eos": True}

    async def run() -> None:
        # The client gives up long before 4 x 480 tokens can be generated.
        async with httpx.AsyncClient(base_url=server.url, timeout=0.1) as client:
            results = await asyncio.gather(
                *[client.post("/v1/completions", json=body) for _ in range(4)],
                return_exceptions=True,
            )
        assert all(isinstance(r, httpx.TimeoutException) for r in results), results

    asyncio.run(run())
    left = time.monotonic()
    state = server.wait_idle(timeout=10.0)  # freed, however long a loaded machine takes
    took = time.monotonic() - left
    assert state["num_running"] == 0 and state["num_waiting"] == 0, (state, took)
    assert state["num_free_blocks"] == state["num_total_blocks"], (state, took)
