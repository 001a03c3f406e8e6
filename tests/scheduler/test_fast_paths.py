"""The scheduler's steady-decode fast paths change nothing: on random workloads (shared
prefixes, stops, aborts, a pool small enough to preempt, chunked prefills, overlap), a
scheduler with them and one without produce the same plans and the same updates, step for
step, and both end with every block free."""

from __future__ import annotations

import random
from collections import deque

import pytest

from stoker.common.ipc import encoder
from tests.fake_worker import EOS, FakeWorker, assert_idle, make, next_token, req


def _workload(seed: int) -> tuple[list, dict, dict[int, list[str]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 90) for _ in range(10)]
    specs, force, aborts = [], {}, {}
    for i in range(24):
        prompt = (shared[: rng.choice([0, 4, 9])] if rng.random() < 0.5 else []) + [
            rng.randrange(1, 90) for _ in range(rng.randrange(1, 20))
        ]
        params = {"ignore_eos": True} if rng.random() < 0.2 else {}
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(1, 90)]
        if specs and rng.random() < 0.3:  # an earlier prompt and outputs: blocks decode filled
            prompt = list(rng.choice(specs)[1])
            for _ in range(rng.randrange(4, 16)):
                prompt.append(next_token(prompt))
        specs.append((f"r{i}", prompt[:24], rng.randrange(1, 30), params))  # fits 30 tokens
        if rng.random() < 0.3:
            force[f"r{i}"] = {rng.randrange(0, 20): EOS}
        if rng.random() < 0.15:
            aborts.setdefault(rng.randrange(1, 60), []).append(f"r{i}")
    return specs, force, aborts


def _drive(fast_paths: bool, seed: int, overlap: bool, **cfg: int) -> tuple[list[bytes], int]:
    specs, force, aborts = _workload(seed)
    burst = cfg.pop("burst", False)  # every request arrives at step 0
    sched = make(**cfg)
    sched.fast_paths = fast_paths
    worker = FakeWorker(force)
    pending = deque(specs)
    trace: list[bytes] = []
    inflight: deque = deque()
    depth = 2 if overlap else 1
    for step in range(5000):
        while pending and (burst or step % 3 == 0):  # else arrivals spread over the run
            rid, prompt, max_tokens, params = pending.popleft()
            sched.add_request(req(rid, prompt, max_tokens, **params))
            if not burst:
                break
        for rid in aborts.get(step, []):
            sched.abort(rid)
        if len(inflight) < depth:
            plan = sched.schedule()
            sched.blocks.check_invariants()
            trace.append(encoder.encode(plan))
            if plan.num_requests or plan.finished_req_ids:
                inflight.append((plan, worker.execute(plan)))
                if plan.num_requests and len(inflight) < depth:
                    continue
        if inflight:
            updates = sched.update(*inflight.popleft())
            sched.blocks.check_invariants()
            trace.append(
                repr([(u.req_id, u.new_token_ids, u.finish_reason) for u in updates]).encode()
            )
        elif not pending and not sched.has_unfinished():
            assert_idle(sched, worker)
            return trace, sched.num_preemptions
    raise AssertionError("never went idle")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "cfg",
    [
        {"num_blocks": 256, "max_num_batched_tokens": 32, "max_num_seqs": 8},
        {"num_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 6},  # preempts
        {"num_blocks": 64, "cache": False, "max_num_batched_tokens": 8, "max_num_seqs": 4},
        {"num_blocks": 128, "max_num_batched_tokens": 16, "max_model_len": 30},  # length stops
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_paths_match_the_general_path(seed: int, overlap: bool, cfg: dict) -> None:
    fast, preemptions = _drive(True, seed, overlap, **cfg)
    general, _ = _drive(False, seed, overlap, **cfg)
    assert fast == general
    assert len(fast) > 100
    assert (preemptions > 0) == (cfg["num_blocks"] == 24)


def test_steady_rows_past_the_budget_wait() -> None:
    """Admission keeps the running count within the budget, so the fast path checks the budget
    in bulk; were the budget to shrink below the running count (here set by hand), the steady
    rows past its end wait a step on both paths."""
    plans = []
    for fast_paths in (True, False):
        sched = make(max_num_batched_tokens=32, max_num_seqs=8)
        sched.fast_paths = fast_paths
        worker = FakeWorker({})
        for i in range(8):
            sched.add_request(req(f"r{i}", [i + 1, i + 2], 20, ignore_eos=True))
        for _ in range(4):  # prefill, decode, one more block: steady decode
            plan = sched.schedule()
            sched.update(plan, worker.execute(plan))
        assert all(r.num_computed_tokens < r.steady_until for r in sched.running)
        sched.config.max_num_batched_tokens = 5
        plans.append(sched.schedule())
    fast, general = plans
    assert encoder.encode(fast) == encoder.encode(general)
    assert fast.running.req_ids == ["r0", "r1", "r2", "r3", "r4"]


@pytest.mark.parametrize("fast_paths", [True, False])
def test_a_prompt_left_one_token_short_of_a_block_end_is_keyed_when_planned(
    fast_paths: bool,
) -> None:
    """A prompt chunk that leaves only the prompt's last token, which ends a block, puts the
    request one token from sampling, as in steady decode; that block is keyed when the step
    computing its last token is planned, on both paths (a waiting request with the same prompt
    then shares it)."""
    sched = make(max_num_batched_tokens=7, max_num_seqs=4)
    sched.fast_paths = fast_paths
    worker = FakeWorker({})
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4
    sched.add_request(req("a", prompt, 4, ignore_eos=True))
    first = sched.schedule()  # 7 of 8 prompt tokens: block 0 keyed, block 1 not yet known
    assert first.new_requests[0].num_scheduled_tokens == 7
    assert sched.blocks.seqs["a"].num_hashed == 1
    sched.update(first, worker.execute(first))
    second = sched.schedule()  # the last prompt token: block 1 is keyed as it is planned
    assert second.running.req_ids == ["a"] and second.running.num_scheduled_tokens == [1]
    assert sched.blocks.seqs["a"].num_hashed == 2
    sched.update(second, worker.execute(second))
    sched.add_request(req("b", [*prompt, 19, 20], 4, ignore_eos=True))
    third = sched.schedule()
    assert third.new_requests[0].num_computed_tokens == 8  # both blocks hit


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_paths_match_the_general_path_across_speculation(
    seed: int, method: str, overlap: bool
) -> None:
    """With a batch cut-off below the running count, steps switch between speculating (every
    request on the general path, verifies in flight) and not (steady-decode rows on the fast
    path): a request's fast-path state must survive the switch both ways. The traces of plans
    and outputs equal the general path's, and the pool ends free."""
    from tests.spec.fakes import SpecFakeWorker, drive, workload
    from tests.spec.fakes import make as make_spec

    def run(fast_paths: bool) -> tuple[list[bytes], dict, int]:
        sched = make_spec(
            method, num_blocks=40, max_batch=4, reqs=workload(seed, n=10), max_num_seqs=8
        )
        sched.fast_paths = fast_paths
        worker = SpecFakeWorker("random", seed=seed)
        result = drive(sched, worker, overlap)
        assert_idle(sched, worker)
        assert sched.spec is not None
        stats = sched.spec.stats
        assert stats.disabled_steps > 0 and stats.drafts > 0  # both kinds of step happened
        return [encoder.encode(p) for p in result.plans], result.outputs, sched.num_preemptions

    fast, general = run(True), run(False)
    assert fast == general
