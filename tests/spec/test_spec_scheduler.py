"""The scheduler with a SpecPolicy, driven by a fake worker that speculates (sans-IO).

`tests/spec/fakes.py` checks, after every schedule and every update: block-manager invariants,
the step budget and seats, a request with a verify in flight is never planned again, verify
sizes respect max_tokens / the context length, n-gram drafts equal a brute-force prompt lookup,
computed counts never pass the blocks held, outputs never pass max_tokens or a stop token, and
the fake KV cache holds the right token at every position a request attends to (so a rolled
back draft, a bad prefix hit or a reused block shows up).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stoker.common.messages import StepPlan
from stoker.services.scheduler.request import FinishReason
from stoker.services.scheduler.scheduler import Scheduler
from stoker.services.scheduler.speculation import PROBE_EVERY, SpecPolicy
from tests.fake_worker import assert_idle
from tests.spec.fakes import (
    Accept,
    Run,
    SpecFakeWorker,
    drive,
    make,
    random_aborts,
    req,
    spec_stats,
    workload,
)

METHODS = ["ngram", "draft"]
POOLS = {"big": 512, "tiny": 14}  # tiny: 56 slots; 4 running requests of up to 56 tokens
CFG = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "max_model_len": 56}


def planned_verifies(run: Run, rid: str) -> list[tuple[int, int]]:
    """(plan index, k) of every verify planned for `rid`, in order."""
    verifies = []
    for i, plan in enumerate(run.plans):
        num_spec = plan.running.num_spec_tokens or [0] * len(plan.running.req_ids)
        for r, k in zip(plan.running.req_ids, num_spec):
            if r == rid and k:
                verifies.append((i, k))
    return verifies


def planned_ks(run: Run, rid: str) -> list[int]:
    """The k of every verify planned for `rid`, in order."""
    return [k for _, k in planned_verifies(run, rid)]


# -- random acceptance: invariants ------------------------------------------------------------


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("overlap", [False, True], ids=["strict", "overlap"])
@pytest.mark.parametrize("method", METHODS)
def test_random_acceptance_keeps_invariants(method: str, overlap: bool, pool: str) -> None:
    preempted = aborted = 0
    for seed in range(3):
        requests = workload(seed)
        sched = make(method, POOLS[pool], reqs=requests, **CFG)
        worker = SpecFakeWorker("random", seed=seed)
        run = drive(sched, worker, overlap, hook=random_aborts(seed, 0.08))
        stats = spec_stats(sched)
        assert stats.drafts > 0 and run.verifies_planned >= stats.drafts
        assert 0 < stats.accepted_tokens < stats.draft_tokens
        assert len(run.reasons) + run.aborted_during_verify == len(requests)
        if pool == "tiny":
            assert sched.num_preemptions > 0
        preempted += run.preempted_during_verify
        aborted += run.aborted_during_verify
        assert_idle(sched, worker)
    assert aborted > 0, "meant to abort requests while their verify ran"
    if overlap and pool == "tiny":  # only with overlap is a verify in flight at planning time
        assert preempted > 0, "meant to preempt requests while their verify ran"


# -- oracle acceptance: outputs equal decoding without speculation ----------------------------


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("overlap", [False, True], ids=["strict", "overlap"])
@pytest.mark.parametrize("method", METHODS)
def test_outputs_match_no_speculation(method: str, overlap: bool, pool: str) -> None:
    """The fake target is greedy: speculation (with any acceptance pattern, preemption, prefix
    hits and overlap) must not change a single output token."""
    for seed in range(2):
        ref_sched = make(None, 512, reqs=workload(seed), **CFG)
        ref = drive(ref_sched, SpecFakeWorker("oracle"), overlap=False)
        sched = make(method, POOLS[pool], reqs=workload(seed), **CFG)
        worker = SpecFakeWorker("oracle", seed=seed)
        run = drive(sched, worker, overlap)
        assert run.outputs == ref.outputs and run.reasons == ref.reasons
        stats = spec_stats(sched)
        assert 0 < stats.accepted_tokens < stats.draft_tokens  # partial acceptance
        assert sched.prefix_hits > 0
        if pool == "tiny":
            assert sched.num_preemptions > 0
        assert_idle(sched, worker)


# -- aborts and preemption in the middle of a verify ------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_abort_while_verify_in_flight(method: str) -> None:
    """Strict steps: abort "a" between sending its verify and receiving the result. Its blocks
    are freed at once, the result is dropped (and not counted), the worker forgets it."""
    sched = make(method, reqs=[req("a", [7, 8, 9] * 4, 20), req("b", [1, 2, 3] * 4, 20)])
    worker = SpecFakeWorker("oracle")
    for _ in range(10):  # until a verify of "a" is planned
        plan = sched.schedule()
        result = worker.execute(plan)
        if "a" in plan.running.req_ids and sched.requests["a"].spec_inflight > 0:
            break
        sched.update(plan, result)
    else:
        raise AssertionError("a never speculated")
    stats = spec_stats(sched)
    drafts_before = stats.drafts
    b_verifies = int(dict(zip(plan.running.req_ids, plan.running.num_spec_tokens)).get("b", 0) > 0)
    assert sched.abort("a")
    sched.blocks.check_invariants()
    assert not sched.blocks.has_seq("a") and "a" not in sched.requests
    updates = sched.update(plan, result)  # the verify's tokens for "a" are dropped
    assert all(u.req_id != "a" for u in updates)
    assert stats.drafts == drafts_before + b_verifies  # a dropped verify is not counted
    nxt = sched.schedule()
    assert "a" in nxt.finished_req_ids and "a" not in nxt.running.req_ids
    sched.update(nxt, worker.execute(nxt))
    assert "a" not in worker.reqs
    run = drive(sched, worker, overlap=False)  # b finishes normally
    assert run.reasons == {"b": FinishReason.LENGTH}
    assert_idle(sched, worker)


@pytest.mark.parametrize("method", METHODS)
def test_abort_with_two_plans_in_flight(method: str) -> None:
    """Overlap: the verify of "a" is in flight and the next plan is already out when "a" is
    aborted; its result arrives afterwards and must be dropped."""
    requests = [req(r, [7, 8, 9, 7, 8, 9, 7, 8], 24) for r in ("a", "b")]
    requests.append(req("long", list(range(1, 90)), 4))  # its chunks keep every plan non-empty
    sched = make(method, reqs=requests, max_num_batched_tokens=16)
    worker = SpecFakeWorker("oracle")
    done: list[bool] = []

    def hook(s: Scheduler, plan: StepPlan, verifying: set[str]) -> None:
        if not done and "a" in verifying and "a" not in plan.running.req_ids:
            done.append(s.abort("a"))  # "a" sits out this plan: its verify is in flight

    run = drive(sched, worker, overlap=True, hook=hook)
    assert done == [True] and run.aborted_during_verify == 1
    assert "a" not in run.reasons and set(run.reasons) == {"b", "long"}
    assert_idle(sched, worker)


@pytest.mark.parametrize("method", METHODS)
def test_preemption_of_speculating_requests(method: str) -> None:
    """A tiny pool forces preemption, some of it while a verify is in flight (overlap):
    its result is dropped, the request resumes (prefix-cache hits) and outputs are unchanged."""
    preempted = 0
    for seed in range(4):
        ref = drive(make(None, 12, reqs=workload(seed), **CFG), SpecFakeWorker(), False)
        sched = make(method, 12, reqs=workload(seed), **CFG)
        worker = SpecFakeWorker("oracle", seed=seed)
        run = drive(sched, worker, overlap=True)
        assert sched.num_preemptions > 0
        assert run.outputs == ref.outputs
        preempted += run.preempted_during_verify
        assert_idle(sched, worker)
    assert preempted > 0


# -- limits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["strict", "overlap"])
@pytest.mark.parametrize("method", METHODS)
def test_max_tokens_and_context_length_never_exceeded(method: str, overlap: bool) -> None:
    """Every draft accepted: a verify yields k + 1 tokens, so k must shrink near max_tokens and
    near the context length; outputs end exactly at the limit."""
    requests = [req(f"m{n}", [4, 5, 6] * 3, n) for n in range(1, 9)]
    requests.append(req("ctx", [4, 5, 6] * 3, 100))  # stopped by max_model_len = 30
    sched = make(method, reqs=requests, max_model_len=30)
    worker = SpecFakeWorker("script", accept=lambda rid, k, i: k)
    run = drive(sched, worker, overlap)
    for n in range(1, 9):
        assert len(run.outputs[f"m{n}"]) == n and run.reasons[f"m{n}"] == FinishReason.LENGTH
    assert len(run.outputs["ctx"]) == 30 - 9
    stats = spec_stats(sched)
    assert stats.accepted_tokens == stats.draft_tokens > 0
    assert_idle(sched, worker)


# -- adaptive policy ------------------------------------------------------------------------------


def _single(accept: Accept, max_tokens: int = 200, adaptive: bool = True) -> tuple[Scheduler, Run]:
    """One draft-model request alone, acceptance scripted; returns the scheduler and the run."""
    request = req("r", [3, 1, 4, 1, 5, 9, 2, 6] * 2, max_tokens)
    sched = make("draft", reqs=[request], adaptive=adaptive)
    run = drive(sched, SpecFakeWorker("script", accept=accept), overlap=False)
    return sched, run


def test_adaptive_k_drops_to_one_under_total_rejection() -> None:
    _, run = _single(lambda rid, k, i: 0, max_tokens=40)
    ks = planned_ks(run, "r")
    assert len(ks) >= 20
    assert ks[:3] == [4, 3, 2]
    assert set(ks[6:-4]) == {1}, ks  # (the last few are cut by max_tokens anyway)


def test_adaptive_k_shrinks_then_climbs_back_to_max_under_full_acceptance() -> None:
    rejections = 8
    _, run = _single(lambda rid, k, i: 0 if i < rejections else k)
    ks = planned_ks(run, "r")
    low, high = ks[:rejections], ks[rejections:]
    assert low[0] == 4 and low == sorted(low, reverse=True) and low[-1] <= 2
    climb = high[: high.index(4) + 1]
    assert climb == sorted(climb) and len(climb) <= 4, high  # back to K within a few verifies
    assert set(high[len(climb) : -3]) == {4}  # stays at K (the last few shrink near max_tokens)


def test_fixed_k_without_adaptive() -> None:
    sched, run = _single(lambda rid, k, i: 0, max_tokens=40, adaptive=False)
    ks = planned_ks(run, "r")
    assert ks and all(k == 4 for k in ks[:-3])
    assert spec_stats(sched).disabled_steps == 0


class CopyingWorker(SpecFakeWorker):
    """A target that repeats its context with period 12, so an n-gram match's continuation
    runs up to 12 ids (the default oracle's period of 3 cuts every match at 3)."""

    @staticmethod
    def target(tokens: Sequence[int]) -> int:
        return tokens[-12] if len(tokens) >= 12 else 1 + len(tokens)


def test_ngram_first_matches_climb_past_the_drafters_k() -> None:
    """With ngram_first, n-gram matches climb past the drafter's k (up to ngram_k) through
    verifies that accept every draft, the drafter never proposes more than its own k, and the
    outputs are those of decoding without speculation."""
    prompt = list(range(10, 22))  # 12 distinct ids, which the target then repeats
    ref = drive(make(None, reqs=[req("r", prompt, 150)]), CopyingWorker("oracle"), False)
    sched = make("draft", reqs=[req("r", prompt, 150)], ngram_first=True, ngram_k=8)
    worker = CopyingWorker("oracle")
    run = drive(sched, worker, overlap=False)
    assert run.outputs == ref.outputs
    ngram_ks = [v.k for v in worker.verifies if v.ngram]
    drafter_ks = [v.k for v in worker.verifies if not v.ngram]
    assert drafter_ks and max(drafter_ks) <= 4
    assert max(ngram_ks) == 8, ngram_ks
    assert len(spec_stats(sched).accepted_per_position) == 8
    assert_idle(sched, worker)


def test_ngram_k_needs_ngram_first() -> None:
    """Without ngram_first a draft-model policy's k is the drafter's, whatever ngram_k says."""
    sched = make("draft", reqs=[req("r", [3, 1, 4, 1, 5, 9, 2, 6] * 2, 100)], ngram_k=8)
    run = drive(sched, SpecFakeWorker("script", accept=lambda rid, k, i: k), overlap=False)
    assert max(planned_ks(run, "r")) == 4


def test_ngram_alone_keeps_its_own_k() -> None:
    """The config turns ngram_first on by default; for the n-gram method alone it means
    nothing, so an explicit k of 4 stays 4 (it once climbed to ngram_k's 8)."""
    prompt = list(range(10, 22))
    sched = make("ngram", reqs=[req("r", prompt, 150)], ngram_first=True, ngram_k=8)
    worker = CopyingWorker("oracle")
    run = drive(sched, worker, overlap=False)
    assert max(planned_ks(run, "r")) == 4
    assert len(spec_stats(sched).accepted_per_position) == 4
    assert_idle(sched, worker)


@pytest.mark.parametrize("method", METHODS)
def test_speculation_off_above_max_batch(method: str) -> None:
    """3 decoding requests with max_batch 2: no drafts, and each such step is counted; once one
    finishes, the other two speculate again."""
    requests = [
        req("short", [2, 7, 1, 8, 2, 8] * 2, 6),
        req("x", [3, 1, 4, 1, 5, 9] * 2, 40),
        req("y", [2, 6, 4, 3, 3, 8] * 2, 40),  # not short's prompt: it would wait to share it
    ]
    sched = make(method, reqs=requests, max_batch=2)
    run = drive(sched, SpecFakeWorker("oracle"), overlap=False)
    stats = spec_stats(sched)
    finished_at = next(
        i for i, p in enumerate(run.plans) if "short" in p.finished_req_ids
    )  # the first plan after "short" finished
    for plan in run.plans[:finished_at]:
        assert not any(plan.running.num_spec_tokens) and not any(plan.running.spec_token_ids)
    assert any(any(p.running.num_spec_tokens) for p in run.plans[finished_at:])
    assert stats.disabled_steps == run.expected_disabled_steps == finished_at - 1  # not plan 0
    assert stats.drafts > 0


def test_prefilling_requests_do_not_switch_speculation_off() -> None:
    """One decoding request and one long prompt being chunk-prefilled, max_batch 1: only one
    request is decoding, so it should speculate while the other prefills."""
    decoding = req("dec", [3, 1, 4, 1, 5, 9, 2, 6] * 2, 30)
    long = req("long", list(range(10, 90)), 2)
    sched = make("draft", reqs=[decoding], max_batch=1, max_num_batched_tokens=8)
    worker = SpecFakeWorker("oracle")
    for _ in range(4):  # "dec" prefills and starts decoding alone
        plan = sched.schedule()
        sched.update(plan, worker.execute(plan))
    sched.add_request(long)
    overlapping = []
    for _ in range(6):  # "long" needs 10 chunks of <= 8 tokens
        plan = sched.schedule()
        assert sched.requests["long"].num_output_tokens == 0  # still prefilling
        num_spec = plan.running.num_spec_tokens or [0] * len(plan.running.req_ids)
        overlapping.append(dict(zip(plan.running.req_ids, num_spec)).get("dec", 0))
        sched.update(plan, worker.execute(plan))
    assert all(k > 0 for k in overlapping), overlapping


def _batch_of_three(accept: Accept, row_cost: float) -> tuple[Scheduler, Run]:
    requests = [req(r, [3 + i, 1, 4, 1, 5, 9, 2, 6] * 2, 60) for i, r in enumerate("xyz")]
    sched = make("draft", reqs=requests, row_cost=row_cost)
    run = drive(sched, SpecFakeWorker("script", accept=accept), overlap=False)
    return sched, run


def test_low_acceptance_sits_out_drafts_in_a_batch_and_probes() -> None:
    """Three decoding requests, row cost 0.3 (min 0.6 accepted drafts per verify), nothing ever
    accepted: k falls 4, 3, 2 as the average halves (2.0, 1.0, 0.5), then each request sits
    out and verifies a single probe draft every PROBE_EVERY x (3 - 1)-th step (the interval
    grows with the batch); the output is unchanged."""
    sched, run = _batch_of_three(lambda rid, k, i: 0, row_cost=0.3)
    assert planned_ks(run, "x")[:3] == [4, 3, 2]
    probes = planned_ks(run, "x")[3:]
    assert probes and set(probes) == {1}
    steps = [i for i, _ in planned_verifies(run, "x")[3:]]
    assert {b - a for a, b in zip(steps, steps[1:])} == {PROBE_EVERY * 2}
    stats = spec_stats(sched)
    assert stats.paused_drafts > 0
    plain_sched, plain = _batch_of_three(lambda rid, k, i: 0, row_cost=0.0)
    assert run.outputs == plain.outputs
    assert spec_stats(plain_sched).paused_drafts == 0


def test_probe_interval_grows_with_the_batch() -> None:
    """Probes cost the batch about the same share of steps at any size: every PROBE_EVERY x
    (decoding requests - 1) steps per sitting-out request, PROBE_EVERY alone or with two."""
    policy = SpecPolicy("draft", 4, row_cost=0.3)
    for num_decoding, interval in [(1, PROBE_EVERY), (2, PROBE_EVERY), (5, 4 * PROBE_EVERY)]:
        assert policy.enabled_for_step(num_decoding)
        assert policy.probe_every == interval


def test_good_acceptance_keeps_drafting_in_a_batch() -> None:
    """Every draft accepted: the average stays at k, far above 0.6, so no request sits out."""
    sched, run = _batch_of_three(lambda rid, k, i: k, row_cost=0.3)
    assert spec_stats(sched).paused_drafts == 0
    assert set(planned_ks(run, "x")[:-3]) == {4}


def test_alone_a_request_never_sits_out() -> None:
    """One decoding request: min accepted drafts is row_cost x 0, whatever the row cost."""
    request = req("r", [3, 1, 4, 1, 5, 9, 2, 6] * 2, 40)
    sched = make("draft", reqs=[request], row_cost=100.0)
    run = drive(sched, SpecFakeWorker("script", accept=lambda rid, k, i: 0), overlap=False)
    assert len(planned_ks(run, "r")) >= 20 and spec_stats(sched).paused_drafts == 0
