"""The scheduler's waiting queue: a deque's interface with O(1) removal from the middle.

An aborted or expired waiting request (a client gone, a deadline, a lost tokenizer) is removed
by id; a deque would scan the whole queue for it, which a flood of aborts turns quadratic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from stoker.services.scheduler.request import Request


class WaitingQueue:
    """FIFO of requests keyed by req_id; appendleft (preemption) and remove are O(1)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Request] = OrderedDict()

    def append(self, request: Request) -> None:
        self._items[request.req_id] = request

    def appendleft(self, request: Request) -> None:
        self._items[request.req_id] = request
        self._items.move_to_end(request.req_id, last=False)

    def popleft(self) -> Request:
        return self._items.popitem(last=False)[1]

    def remove(self, request: Request) -> None:
        del self._items[request.req_id]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of the waiting queue is addressable")
        return next(iter(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())
