"""Scheduler core, driven by a fake worker that mirrors the real one's bookkeeping.

The fake worker (`tests/fake_worker.py`) keeps per-request tokens, block tables and computed
counts from plans alone (as `ModelRunner._apply_plan` does), samples when a request's computed
tokens reach its known tokens, and returns tokens that depend only on the context. It also keeps a
fake KV cache (slot -> token) and checks that every position a request attends to holds that
request's token, so bad prefix hits or reused blocks show up. Outputs can then be compared across
scheduling configurations.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable

import pytest

from stoker.common.messages import (
    NewRequestData,
    StepPlan,
    StepResult,
    TokenLogprobs,
    num_ids,
    pack_ids,
)
from stoker.services.scheduler.request import FinishReason, Request
from stoker.services.scheduler.scheduler import Scheduler
from tests.fake_worker import EOS, VOCAB, FakeWorker, assert_idle, make, req


@dataclasses.dataclass
class Run:
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    reasons: dict[str, FinishReason] = dataclasses.field(default_factory=dict)
    news: list[NewRequestData] = dataclasses.field(default_factory=list)


def checked_schedule(sched: Scheduler, run: Run) -> StepPlan:
    before = sched.num_preemptions
    plan = sched.schedule()
    sched.blocks.check_invariants()
    cfg = sched.config
    counts = [n.num_scheduled_tokens for n in plan.new_requests] + plan.running.num_scheduled_tokens
    assert sum(counts) <= cfg.max_num_batched_tokens and all(n >= 1 for n in counts)
    assert plan.num_requests <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
    ids = [n.req_id for n in plan.new_requests] + plan.running.req_ids
    assert len(set(ids)) == len(ids)
    preempted = [rid for rid in plan.finished_req_ids if rid in sched.requests]
    assert len(preempted) == sched.num_preemptions - before
    if preempted:  # back at the front of the queue, and nothing admitted this step
        assert not plan.new_requests
        assert [r.req_id for r in sched.waiting][: len(preempted)] == preempted[::-1]
    run.news.extend(plan.new_requests)
    return plan


def record(sched: Scheduler, plan: StepPlan, result: StepResult, run: Run) -> None:
    for u in sched.update(plan, result):
        assert u.req_id not in run.reasons, "a token after the finish"
        out = run.outputs.setdefault(u.req_id, [])
        out.extend(u.new_token_ids)
        assert out == u.request.output_token_ids
        if u.finish_reason is not None:
            run.reasons[u.req_id] = u.finish_reason
            assert u.req_id not in sched.requests and not sched.blocks.has_seq(u.req_id)
    sched.blocks.check_invariants()


Hook = Callable[[Scheduler, StepPlan], None]


def drive(sched: Scheduler, worker: FakeWorker, overlap: bool, hook: Hook | None = None) -> Run:
    """The service's step loop: up to 2 plans in flight with overlap, else strict alternation."""
    run, depth = Run(), 2 if overlap else 1
    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    for _ in range(3000):
        if len(inflight) < depth:
            plan = checked_schedule(sched, run)
            if plan.num_requests or plan.finished_req_ids:
                inflight.append((plan, worker.execute(plan)))  # the worker runs plans in order
                assert not set(plan.finished_req_ids) & worker.reqs.keys()
                if hook is not None:
                    hook(sched, plan)
                if plan.num_requests and len(inflight) < depth:
                    continue
        if not inflight:
            return run
        record(sched, *inflight.popleft(), run)
    raise AssertionError("never went idle")


def test_budget_seats_and_chunked_prefill() -> None:
    results = []
    for overlap in (False, True):
        sched, worker = make(max_num_batched_tokens=16, max_num_seqs=3), FakeWorker()
        for rid, n, max_tokens in [("a", 3, 10), ("b", 3, 10), ("long", 40, 3), ("d", 5, 4)]:
            sched.add_request(req(rid, [(7 * i + n) % 90 + 1 for i in range(n)], max_tokens))
        run = drive(sched, worker, overlap)
        prefill, total = [], 0
        for step, n in worker.chunks["long"]:
            if total < 40:
                prefill.append(step)
            total += n
        assert len(prefill) >= 3  # chunked, and the request samples only after its last chunk
        assert worker.sampled["long"][0] == prefill[-1]
        for step in prefill[1:]:  # decodes share the chunked steps
            assert (step, 1) in worker.chunks["a"] and (step, 1) in worker.chunks["b"]
        first_finish = min(worker.sampled[r][-1] for r in ("a", "b", "long"))
        assert worker.chunks["d"][0][0] > first_finish  # d waited for a seat
        assert set(run.reasons.values()) == {FinishReason.LENGTH}
        assert_idle(sched, worker)
        results.append(run.outputs)
    assert results[0] == results[1]


def test_prefill_chunk_caps_prompt_tokens_and_never_decodes() -> None:
    """prefill_chunk_tokens caps each step's prompt tokens, new or running; decodes ride on top,
    so the running requests keep decoding while long prompts trickle in. Same tokens as with no
    cap."""
    prompts = {f"d{i}": 3 for i in range(5)} | {"long1": 30, "long2": 21, "late": 9}
    outputs = []
    for chunk in (0, 8):  # 0: no cap
        for overlap in (False, True):
            sched = make(max_num_batched_tokens=64, max_num_seqs=8, prefill_chunk_tokens=chunk)
            worker = FakeWorker()
            for rid, n in prompts.items():
                sched.add_request(req(rid, [(5 * i + n) % 90 + 1 for i in range(n)], 12))
            run = drive(sched, worker, overlap)
            prompt_tokens: dict[int, int] = {}
            decodes: dict[int, int] = {}
            for rid, n_prompt in prompts.items():
                done = 0
                for step, n in worker.chunks[rid]:
                    # A prompt's last token alone is computed as a decode is, and not counted.
                    in_prompt = min(n, max(0, n_prompt - done)) if n > 1 else 0
                    prompt_tokens[step] = prompt_tokens.get(step, 0) + in_prompt
                    decodes[step] = decodes.get(step, 0) + n - in_prompt
                    done += n
            if chunk:
                assert max(prompt_tokens.values()) == chunk
                # The long prompts took several steps, and the short ones decoded meanwhile.
                long_steps = [s for s, _ in worker.chunks["long1"]][:4]
                assert all(decodes[s] >= 4 for s in long_steps[1:])
            assert_idle(sched, worker)
            outputs.append(run.outputs)
    assert all(o == outputs[0] for o in outputs)


STOP_CASES = {  # params, max_tokens, forced {output index: token}, max_model_len, reason, n out
    "eos": ({}, 8, {2: EOS}, 2048, FinishReason.STOP, 3),
    "ignore_eos": ({"ignore_eos": True}, 5, {2: EOS}, 2048, FinishReason.LENGTH, 5),
    "stop_token": ({"stop_token_ids": [5]}, 8, {1: 5}, 2048, FinishReason.STOP, 2),
    "max_tokens": ({}, 4, {}, 2048, FinishReason.LENGTH, 4),
    "max_model_len": ({}, 100, {}, 12, FinishReason.LENGTH, 3),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", list(STOP_CASES))
def test_stops(case: str, overlap: bool) -> None:
    params, max_tokens, force, max_model_len, reason, n_out = STOP_CASES[case]
    sched, worker = make(max_model_len=max_model_len), FakeWorker({"r": force})
    sched.add_request(req("r", list(range(1, 10)), max_tokens, **params))
    sched.add_request(req("other", [3, 1, 4], 6))
    run = drive(sched, worker, overlap)
    assert run.reasons == {"r": reason, "other": FinishReason.LENGTH}
    assert len(run.outputs["r"]) == n_out and len(run.outputs["other"]) == 6
    if force.get(n_out - 1) is not None:
        assert run.outputs["r"][-1] == force[n_out - 1]
    # With overlap, an unforeseeable stop costs one surplus token (dropped); a length stop none.
    surplus = 1 if overlap and reason == FinishReason.STOP else 0
    assert len(worker.sampled["r"]) == n_out + surplus
    assert_idle(sched, worker)


def tiny_pool_prompts() -> list[Request]:
    # r1 finishes just after the first preemption, so the victim's cached blocks survive.
    max_tokens = [14, 4, 14, 14]
    return [req(f"r{i}", [10 * i + j + 1 for j in range(6)], max_tokens[i]) for i in range(4)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", [True, False])
def test_preemption(cache: bool, overlap: bool) -> None:
    ref_sched = make(num_blocks=1000, reqs=tiny_pool_prompts())
    ref = drive(ref_sched, FakeWorker(), overlap=False)
    assert ref_sched.num_preemptions == 0
    sched = make(num_blocks=10, cache=cache, reqs=tiny_pool_prompts())  # 40 slots, 4 x 20 tokens
    worker = FakeWorker()
    run = drive(sched, worker, overlap)  # checks: front of queue, no admission, state dropped
    assert sched.num_preemptions > 0
    resumed = [n for i, n in enumerate(run.news) if n.req_id in {m.req_id for m in run.news[:i]}]
    assert resumed and all(num_ids(n.output_token_ids) for n in resumed)
    hits = [n.num_computed_tokens for n in resumed]
    assert any(hits) if cache else not any(hits)
    assert run.outputs == ref.outputs and run.reasons == ref.reasons
    assert_idle(sched, worker)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", [True, False])
def test_prefix_caching(cache: bool, overlap: bool) -> None:
    sched, worker = make(cache=cache), FakeWorker()
    shared = list(range(1, 11))
    sched.add_request(req("a", shared + [11, 12], 3))
    first = drive(sched, worker, overlap)
    sched.add_request(req("b", shared + [13, 14, 15], 3))  # shares 2 full blocks
    sched.add_request(req("c", shared + [11, 12], 3))  # a's prompt: 3 cached blocks
    sched.add_request(req("d", shared[:9], 3))  # cached up to its last token
    second = drive(sched, worker, overlap)
    got = {n.req_id: (n.num_computed_tokens, n.num_scheduled_tokens) for n in second.news}
    if cache:  # the last prompt token is always computed, so c recomputes its last block
        assert got == {"b": (8, 5), "c": (8, 4), "d": (8, 1)}
    else:
        assert got == {"b": (0, 13), "c": (0, 12), "d": (0, 9)}
    assert second.outputs["c"] == first.outputs["a"]
    assert_idle(sched, worker)


def test_abort() -> None:
    sched, worker, run = make(max_num_seqs=1), FakeWorker(), Run()
    sched.add_request(req("a", [1, 2, 3, 4, 5], 10))
    sched.add_request(req("b", [6, 7, 8, 9, 10], 10))
    assert not sched.abort("unknown")
    plan = checked_schedule(sched, run)  # a admitted and sampling; b waits for the seat
    result = worker.execute(plan)
    assert [n.req_id for n in plan.new_requests] == ["a"] and result.req_ids == ["a"]
    assert sched.abort("b") and sched.num_waiting == 0  # waiting
    assert sched.abort("a") and not sched.blocks.has_seq("a")  # running, its step in flight
    sched.blocks.check_invariants()
    assert sched.update(plan, result) == []  # the in-flight token is dropped
    assert not sched.abort("a")  # already gone
    plan = checked_schedule(sched, run)
    assert plan.finished_req_ids == ["a"] and plan.num_requests == 0  # b never reached it
    worker.execute(plan)
    assert_idle(sched, worker)
    sched.add_request(req("c", [1, 2, 3], 2))
    drive(sched, worker, overlap=True)
    assert not sched.abort("c")  # finished
    assert_idle(sched, worker)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_while_running_frees_everything(overlap: bool) -> None:
    sched, worker = make(num_blocks=12, reqs=tiny_pool_prompts()), FakeWorker()

    def hook(s: Scheduler, plan: StepPlan) -> None:
        if plan.step_id == 6:
            assert s.abort("r0") and s.abort("r3")

    run = drive(sched, worker, overlap, hook)
    assert "r0" not in run.reasons and "r3" not in run.reasons
    assert run.reasons == {"r1": FinishReason.LENGTH, "r2": FinishReason.LENGTH}
    assert_idle(sched, worker)


def workload(seed: int) -> tuple[list[Request], dict[str, dict[int, int]]]:
    rng = random.Random(seed)
    bases = [[rng.randrange(1, VOCAB) for _ in range(12)] for _ in range(2)]
    requests, force = [], {}
    for i in range(8):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 24))]
        if rng.random() < 0.5:
            prompt = rng.choice(bases)[: rng.randrange(4, 13)] + prompt
        params: dict[str, object] = {}
        if rng.random() < 0.3:
            params["stop_token_ids"] = [5]
            force[f"q{i}"] = {rng.randrange(0, 10): 5}
        elif rng.random() < 0.4:
            params["ignore_eos"] = rng.random() < 0.5
            force[f"q{i}"] = {rng.randrange(0, 10): EOS}
        requests.append(req(f"q{i}", prompt, rng.randrange(1, 20), **params))
    return requests, force


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cache", [True, False])
def test_overlap_matches_strict(seed: int, cache: bool) -> None:
    outcomes = []
    for num_blocks, overlap in [(1000, False), (12, False), (12, True), (1000, True)]:
        requests, force = workload(seed)
        cfg = {"max_num_batched_tokens": 24, "max_num_seqs": 4, "max_model_len": 48}
        sched, worker = make(num_blocks, cache, requests, **cfg), FakeWorker(force)
        run = drive(sched, worker, overlap)
        assert len(run.reasons) == len(requests)
        if num_blocks == 12:
            assert sched.num_preemptions > 0
        assert_idle(sched, worker)
        outcomes.append((run.outputs, run.reasons))
    assert all(o == outcomes[0] for o in outcomes)


def test_request_outgrowing_the_pool_does_not_hang() -> None:
    # Regression: at 17 tokens it used to preempt itself and never be readmitted. The context
    # length is now capped at the pool's capacity (16 tokens), so it stops with LENGTH.
    sched, worker = make(num_blocks=4, max_model_len=64), FakeWorker()
    sched.add_request(req("a", list(range(1, 11)), 20))
    drive(sched, worker, overlap=False)
    assert not sched.has_unfinished()


def test_prompt_of_a_one_step_request_is_cached() -> None:
    # Regression: update() used to free a finishing request before caching the blocks its
    # final step filled, so max_tokens=1 (or EOS first) left nothing in the prefix cache.
    sched, worker = make(), FakeWorker()
    prompt = list(range(1, 13))
    sched.add_request(req("a", prompt, 1))
    drive(sched, worker, overlap=False)
    sched.add_request(req("b", prompt, 1))
    run = drive(sched, worker, overlap=False)
    assert run.news[0].num_computed_tokens == 8


def test_num_cached_tokens_is_the_hit_at_admission() -> None:
    # Regression: b's failed first admission attempt hits c's cached block and gives it back;
    # a then evicts it, so b is admitted with no hit and must report 0 cached tokens.
    sched, worker = make(num_blocks=6), FakeWorker()
    sched.add_request(req("c", list(range(1, 9)), 2))
    drive(sched, worker, overlap=False)
    sched.add_request(req("a", list(range(60, 80)), 3))
    sched.add_request(b := req("b", [1, 2, 3, 4, 90, 91, 92, 93], 2))
    run = drive(sched, worker, overlap=False)
    assert [(n.req_id, n.num_computed_tokens) for n in run.news] == [("a", 0), ("b", 0)]
    assert b.num_cached_tokens == 0


def test_logprobs_only_for_requests_that_asked() -> None:
    """A step result carries None rows for requests that did not ask for logprobs; their
    updates must say None, not [None] (the token batch's wire type has no None entries: the
    tokenizer dropped whole batches when one request in a step asked and another did not)."""
    sched = make()
    sched.add_request(req("a", [1, 2, 3], 4))
    sched.add_request(req("b", [4, 5, 6], 4))
    plan = sched.schedule()
    lp = TokenLogprobs(-0.5, [7], [-0.5])
    result = StepResult(plan.step_id, ["a", "b"], pack_ids([7, 8]), logprobs=[lp, None])
    updates = {u.req_id: u for u in sched.update(plan, result)}
    assert updates["a"].logprobs == [lp]
    assert updates["b"].logprobs is None
