"""DeltaQueue: the api's per-call queue of deltas (one consumer, unbounded)."""

from __future__ import annotations

import asyncio

import pytest

from stoker.common.messages import TextDelta
from stoker.services.api.delta_queue import DeltaQueue


def _delta(i: int) -> TextDelta:
    return TextDelta(f"r-{i}", str(i), b"")


def test_gets_come_in_put_order_and_get_all_takes_the_backlog() -> None:
    async def main() -> None:
        q = DeltaQueue()
        for i in range(3):
            q.put_nowait(_delta(i))
        assert q.qsize() == 3 and not q.empty()
        assert (await q.get()).text == "0"
        assert [d.text for d in await q.get_all()] == ["1", "2"]
        assert q.empty()
        with pytest.raises(asyncio.QueueEmpty):
            q.get_nowait()

    asyncio.run(main())


def test_a_waiting_consumer_wakes_on_the_next_put() -> None:
    async def main() -> None:
        q = DeltaQueue()
        waiting = asyncio.ensure_future(q.get_all())
        await asyncio.sleep(0)
        assert not waiting.done()
        q.put_nowait(_delta(0))
        q.put_nowait(_delta(1))  # before the consumer runs: both in one take
        assert [d.text for d in await asyncio.wait_for(waiting, 5)] == ["0", "1"]

    asyncio.run(main())


def test_a_cancelled_wait_loses_nothing_and_a_new_consumer_takes_over() -> None:
    async def main() -> None:
        q = DeltaQueue()
        first = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        q.put_nowait(_delta(7))  # the cancelled waiter is skipped, the delta kept
        assert q.get_nowait().text == "7"
        second = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put_nowait(_delta(8))
        assert (await asyncio.wait_for(second, 5)).text == "8"

    asyncio.run(main())


def test_a_second_concurrent_consumer_is_refused() -> None:
    async def main() -> None:
        q = DeltaQueue()
        first = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one consumer"):
            await q.get()
        q.put_nowait(_delta(1))
        assert (await asyncio.wait_for(first, 5)).text == "1"

    asyncio.run(main())
