"""The queue one API call's deltas arrive on: the EngineClient puts, the call's handler gets."""

from __future__ import annotations

import asyncio
import collections

from stoker.common.messages import TextDelta


class DeltaQueue:
    """The part of asyncio.Queue the api uses (unbounded, one consumer), at a fraction of its
    cost: at hundreds of streams every streamed token is one put, and asyncio.Queue spends
    five Python calls on each (its maxsize check, its getters' bookkeeping). A put here is an
    append, plus one future set while the consumer waits; `get_all` takes a lagging stream's
    backlog in one call."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[TextDelta] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None  # the consumer, while it waits

    def put_nowait(self, delta: TextDelta) -> None:
        self._items.append(delta)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # cancelled if the consumer gave up waiting
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self) -> TextDelta:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> TextDelta:
        await self._wait()
        return self._items.popleft()

    async def get_all(self) -> list[TextDelta]:
        """Everything queued, waiting for at least one delta."""
        await self._wait()
        items = list(self._items)
        self._items.clear()
        return items

    async def _wait(self) -> None:
        while not self._items:
            if self._waiter is not None and not self._waiter.done():
                raise RuntimeError("DeltaQueue has one consumer; a second one is waiting")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
