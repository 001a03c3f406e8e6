"""A decode that fills its last block takes the next one plus up to DECODE_SPARE_BLOCKS spares
while the pool has room (services/scheduler/scheduler.py, `_spare_blocks`): fewer stops for
blocks, the same tokens, and every block back at idle."""

from __future__ import annotations

from collections import deque

import pytest

import services.scheduler.scheduler as scheduler_module
from services.scheduler.scheduler import DECODE_SPARE_BLOCKS
from tests.fake_worker import FakeWorker, assert_idle, make, req


def _run(sched, worker: FakeWorker, overlap: bool = True) -> tuple[list, dict[str, list[int]]]:
    """Drive to idle; the plans in order, and each request's tokens."""
    plans, inflight, tokens = [], deque(), {}
    depth = 2 if overlap else 1
    while sched.has_unfinished() or inflight:
        if len(inflight) < depth and sched.has_unfinished():
            plan = sched.schedule()
            sched.blocks.check_invariants()
            plans.append(plan)
            if plan.num_requests or plan.finished_req_ids:
                inflight.append((plan, worker.execute(plan)))
                if plan.num_requests and len(inflight) < depth:
                    continue
        if inflight:
            for u in sched.update(*inflight.popleft()):
                tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            sched.blocks.check_invariants()
    worker.execute(sched.schedule())  # the last finished ids: the worker drops their state
    return plans, tokens


def _new_blocks(plans, rid: str) -> list[list[int]]:
    """The new block ids each decode row of `rid` carried (rows with none left out)."""
    out = []
    for plan in plans:
        for row, r in enumerate(plan.running.req_ids):
            if r == rid and plan.running.new_block_ids[row]:
                out.append(plan.running.new_block_ids[row])
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_takes_spares_up_to_its_limit_and_the_tokens_do_not_change(
    overlap: bool, monkeypatch
):
    runs = {}
    for spares in (DECODE_SPARE_BLOCKS, 0):
        monkeypatch.setattr(scheduler_module, "DECODE_SPARE_BLOCKS", spares)
        sched = make(num_blocks=256, watermark=0.0)
        worker = FakeWorker()
        sched.add_request(req("a", [1, 2, 3], 40, ignore_eos=True))
        sched.add_request(req("b", [4, 5, 6, 7, 8], 40))
        plans, tokens = _run(sched, worker, overlap)
        assert_idle(sched, worker)
        runs[spares] = [len(g) for g in _new_blocks(plans, "a")], tokens
    # "a" computes at most 3 + 40 - 1 positions: 11 blocks of 4, one taken at admission. Each
    # stop takes 1 + 3 while that fits, then what is left.
    assert runs[DECODE_SPARE_BLOCKS][0] == [4, 4, 2]
    assert runs[0][0] == [1] * 10
    assert runs[DECODE_SPARE_BLOCKS][1] == runs[0][1]  # the same tokens, request for request


def test_no_spares_unless_every_running_request_could_take_them():
    """8 requests that need 32 blocks in all: a pool of 34 has room for them but not for
    8 x (1 + 3) blocks ahead, so each stop takes one block; a roomy pool hands out spares."""
    for num_blocks, want in ((34, [1, 1, 1]), (256, [3])):
        sched = make(num_blocks=num_blocks, watermark=0.0, max_num_seqs=8)
        worker = FakeWorker()
        for i in range(8):
            sched.add_request(req(f"r{i}", [1 + i, 2, 3], 12, ignore_eos=True))
        plans, tokens = _run(sched, worker)
        assert_idle(sched, worker)
        assert sched.num_preemptions == 0 and all(len(t) == 12 for t in tokens.values())
        for i in range(8):  # 3 + 12 - 1 positions: 4 blocks, one at admission
            assert [len(g) for g in _new_blocks(plans, f"r{i}")] == want


def test_spares_stop_at_the_token_limit_and_an_abort_frees_them():
    sched = make(num_blocks=256, watermark=0.0)
    worker = FakeWorker()
    sched.add_request(req("a", [1, 2, 3, 4], 6, ignore_eos=True))  # 9 positions: 3 blocks
    sched.add_request(req("b", [1, 2, 3], 30, ignore_eos=True))  # 32 positions: 8 blocks
    for _ in range(3):  # prefill, then each decode's first stop
        plan = sched.schedule()
        sched.update(plan, worker.execute(plan))
    assert len(sched.blocks.block_table("a")) == 3  # 1, then 1 + 1 spare: its limit
    assert len(sched.blocks.block_table("b")) == 1 + 1 + DECODE_SPARE_BLOCKS
    sched.abort("b")
    assert "b" not in sched.blocks.seqs
    sched.blocks.check_invariants()
    assert sched.blocks.num_free_blocks() == 256 - 3
    _run(sched, worker)
    assert_idle(sched, worker)
