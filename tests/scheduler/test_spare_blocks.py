"""A decode that fills its last block takes the next one plus up to DECODE_SPARE_BLOCKS spares
while the pool has room (services/scheduler/scheduler.py, `_spare_blocks`): fewer stops for
blocks, the same tokens, and every block back at idle."""

from __future__ import annotations

from collections import deque

import pytest

import stoker.services.scheduler.scheduler as scheduler_module
from stoker.services.scheduler.scheduler import DECODE_SPARE_BLOCKS
from tests.fake_worker import EOS, FakeWorker, assert_idle, make, req
from tests.scheduler.test_fast_paths import _drive


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


def test_no_spares_unless_every_running_request_could_take_them(monkeypatch):
    """8 requests that need 32 blocks in all: a pool of 34 has room for them but not for
    8 x (1 + 3) blocks ahead, so each stop takes one block; a roomy pool hands out spares.
    (The pool-share rule is lifted to test this one alone.)"""
    monkeypatch.setattr(scheduler_module, "SPARE_POOL_SHARE", 1)
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


def test_a_small_pool_gives_no_spares_and_keeps_its_cached_prefix(monkeypatch):
    """16 blocks, 10 of them a cached prompt: 3 spares would be 1/5 of the pool, past the
    share spares may hold (1/SPARE_POOL_SHARE), so a decode takes none and the prompt, sent
    again, still hits in full. Lifting the share rule, the spares evict part of it."""
    prompt = [10 + i for i in range(40)]  # 10 full blocks
    hits = {}
    for spares in (DECODE_SPARE_BLOCKS, 0):
        monkeypatch.setattr(scheduler_module, "DECODE_SPARE_BLOCKS", spares)
        sched = make(num_blocks=16, watermark=0.0, max_num_batched_tokens=64)
        worker = FakeWorker({"a": {2: EOS}})  # stops soon after its first block stop
        sched.add_request(req("x", prompt, 1))
        _run(sched, worker)
        sched.add_request(req("a", [1] * 11, 40))
        _run(sched, worker)
        before = sched.prefix_hits
        sched.add_request(req("x2", [*prompt, 99, 98], 1))
        _run(sched, worker)
        assert_idle(sched, worker)
        hits[spares] = sched.prefix_hits - before
    assert hits == {DECODE_SPARE_BLOCKS: 40, 0: 40}
    monkeypatch.setattr(scheduler_module, "DECODE_SPARE_BLOCKS", DECODE_SPARE_BLOCKS)
    monkeypatch.setattr(scheduler_module, "SPARE_POOL_SHARE", 1)
    sched = make(num_blocks=16, watermark=0.0, max_num_batched_tokens=64)
    worker = FakeWorker({"a": {2: EOS}})
    for rid, p in (("x", prompt), ("a", [1] * 11)):
        sched.add_request(req(rid, p, 1 if rid == "x" else 40))
        _run(sched, worker)
    before = sched.prefix_hits
    sched.add_request(req("x2", [*prompt, 99, 98], 1))
    _run(sched, worker)
    assert sched.prefix_hits - before < 40


def test_no_spares_while_a_prompt_is_being_chunked(monkeypatch):
    """A long prompt computed in chunks beside a decode: the decode's block stop takes no
    spares while the prompt has chunks left (they would take the next chunk's blocks and
    preempt it), and spares again once the prompt is done. (The pool-share rule is lifted:
    20 blocks.)"""
    monkeypatch.setattr(scheduler_module, "SPARE_POOL_SHARE", 1)
    sched = make(num_blocks=20, watermark=0.0, max_num_batched_tokens=33)
    worker = FakeWorker()
    sched.add_request(req("a", [1, 2, 3], 40, ignore_eos=True))
    plan = sched.schedule()
    sched.update(plan, worker.execute(plan))
    sched.add_request(req("b", [10 + i % 50 for i in range(64)], 1, ignore_eos=True))
    plans, tokens = _run(sched, worker, overlap=False)
    assert_idle(sched, worker)
    assert sched.num_preemptions == 0 and len(tokens["b"]) == 1 and len(tokens["a"]) == 39
    grown = _new_blocks(plans, "a")
    assert len(grown[0]) == 1  # its first stop came while b was still chunking
    assert any(len(g) > 1 for g in grown)  # later ones, with b done, took spares


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_paths_match_the_general_path_with_spares_and_preemption(
    seed: int, overlap: bool, monkeypatch
):
    """test_fast_paths' preempting workload with the pool-share rule lifted, so that spares
    are taken in a pool that runs short: both paths still plan byte for byte alike."""
    monkeypatch.setattr(scheduler_module, "SPARE_POOL_SHARE", 1)
    cfg = {"num_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 6}
    fast, _ = _drive(True, seed, overlap, **cfg)
    general, _ = _drive(False, seed, overlap, **cfg)
    assert fast == general and len(fast) > 100
