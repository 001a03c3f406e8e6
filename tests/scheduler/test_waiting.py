"""The waiting queue keeps deque order semantics and removes from the middle by id."""

from __future__ import annotations

from stoker.common.sampling_params import SamplingParams
from stoker.services.scheduler.request import Request
from stoker.services.scheduler.waiting import WaitingQueue


def _req(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(), 4, (0,))


def test_fifo_appendleft_and_remove():
    q = WaitingQueue()
    reqs = [_req(i) for i in range(5)]
    for r in reqs:
        q.append(r)
    assert len(q) == 5 and q[0] is reqs[0]
    q.remove(reqs[2])  # from the middle
    assert [r.req_id for r in q] == ["r0", "r1", "r3", "r4"]
    assert q.popleft() is reqs[0]
    q.appendleft(reqs[0])  # a preempted request goes back to the head
    assert q[0] is reqs[0]
    while q:
        q.popleft()
    assert len(q) == 0 and not q
