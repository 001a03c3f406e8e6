"""The scheduler's outbox on its own: batches past a tokenizer's full queue wait in order and are
handed on as it drains; a tokenizer that is gone, or takes nothing for TOKENIZER_STALL_S, goes
to on_lost; nothing is dropped silently. In-process sockets, so the queues fill at once (the
whole-service variant with OS buffers is tests/reliability/test_backpressure.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import zmq
import zmq.asyncio

from stoker.common.addresses import API_ROUTING_ID
from stoker.common.ipc import api_from_scheduler_decoder, tokenizer_inbound_decoder
from stoker.common.messages import EngineFailure, RequestTokens, TokenBatch, pack_ids, unpack_ids
from stoker.services.scheduler import tokenizer_outbox
from stoker.services.scheduler.tokenizer_outbox import TokenizerOutbox, bind_router

TOKENIZER = b"tok-0"
Check = Callable[[TokenizerOutbox, zmq.asyncio.Socket, list[bytes]], Awaitable[None]]


@pytest.fixture(autouse=True)
def small_queues(monkeypatch):
    monkeypatch.setattr(tokenizer_outbox, "TOKENIZER_HWM", 4)


def _run(check: Check) -> None:
    """check(outbox, tokenizer, lost) with a connected tokenizer (receive queue of 4)."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            router = bind_router(ctx, "inproc://scheduler")
            lost: list[bytes] = []
            tokenizer = ctx.socket(zmq.DEALER)
            tokenizer.setsockopt(zmq.ROUTING_ID, TOKENIZER)
            tokenizer.setsockopt(zmq.RCVHWM, 4)
            tokenizer.connect("inproc://scheduler")
            await tokenizer.send(b"hello")  # until the router has heard it, it cannot route to it
            await asyncio.wait_for(router.recv_multipart(), 5)
            await check(TokenizerOutbox(router, lost.append), tokenizer, lost)
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())


def _send(outbox: TokenizerOutbox, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        outbox.send_items({TOKENIZER: [RequestTokens("r-1", pack_ids([i]))]})


async def _drain(tokenizer: zmq.asyncio.Socket) -> list[int]:
    got: list[int] = []
    while await tokenizer.poll(0):
        batch = tokenizer_inbound_decoder.decode(await tokenizer.recv())
        got += [unpack_ids(item.token_ids)[0] for item in batch.items]
    return got


def test_batches_past_a_full_queue_wait_and_arrive_in_order() -> None:
    async def check(outbox: TokenizerOutbox, tokenizer: zmq.asyncio.Socket, lost: list) -> None:
        _send(outbox, 40)
        assert len(outbox.backlog[TOKENIZER]) > 20, "the queue never filled"
        _send(outbox, 10, start=40)  # a later batch queues behind the held ones
        received: list[int] = []
        for _ in range(200):  # read as a tokenizer does, flush as the step loop does
            if len(received) == 50:
                break
            if await tokenizer.poll(10):
                received += await _drain(tokenizer)
            outbox.flush()
        assert received == list(range(50))
        assert not outbox.backlog and not lost

    _run(check)


def test_a_tokenizer_that_takes_nothing_is_lost_after_the_stall(monkeypatch) -> None:
    monkeypatch.setattr(tokenizer_outbox, "TOKENIZER_STALL_S", 0.05)

    async def check(outbox: TokenizerOutbox, tokenizer: zmq.asyncio.Socket, lost: list) -> None:
        _send(outbox, 20)
        outbox.flush()
        assert outbox.backlog and not lost  # held, not failed: it may still catch up
        await asyncio.sleep(0.1)
        outbox.flush()
        assert lost == [TOKENIZER] and not outbox.backlog

    _run(check)


def test_an_unknown_tokenizer_is_lost_at_once() -> None:
    async def check(outbox: TokenizerOutbox, tokenizer: zmq.asyncio.Socket, lost: list) -> None:
        outbox.send_items({b"tok-gone": [RequestTokens("r-2", pack_ids([1]))]})
        assert lost == [b"tok-gone"] and not outbox.backlog

    _run(check)


def test_empty_batches_are_skipped_and_an_absent_api_is_no_error() -> None:
    async def check(outbox: TokenizerOutbox, tokenizer: zmq.asyncio.Socket, lost: list) -> None:
        outbox.send_batches({TOKENIZER: TokenBatch([])})
        outbox.send_api(EngineFailure("nobody listens yet"))
        api = tokenizer.context.socket(zmq.DEALER)
        api.setsockopt(zmq.ROUTING_ID, API_ROUTING_ID)
        api.connect("inproc://scheduler")
        await api.send(b"hello")
        await asyncio.wait_for(outbox.router.recv_multipart(), 5)
        outbox.send_api(EngineFailure("now it does"))
        msg = api_from_scheduler_decoder.decode(await asyncio.wait_for(api.recv(), 5))
        assert isinstance(msg, EngineFailure) and msg.message == "now it does"
        assert not await tokenizer.poll(0) and not lost

    _run(check)
