"""A fake worker that speculates, and a checked driver for the sans-IO scheduler.

`SpecFakeWorker` extends `tests/fake_worker.py`'s `FakeWorker` (which mirrors `ModelRunner`'s
bookkeeping from plans alone: per-request tokens, block tables, computed counts, and a fake KV
cache checked at every position a request attends to) with verify chunks: [last token, *drafts]
with k + 1 positions, drafts from the plan (n-gram) or from its own fake drafter (draft model,
`num_spec_tokens` > 0 with no ids). So a rollback that keeps a rejected draft's K/V, a bad
prefix-cache hit or a reused block shows up.

Acceptance modes:
- "oracle": the fake target is the deterministic `oracle` (greedy). A verify accepts the longest
  prefix of drafts equal to the oracle's tokens plus the oracle's next token, so outputs must be
  identical with and without speculation.
- "random": a uniformly random number of accepted drafts (1 to k + 1 tokens per verify).
- "script": `accept(req_id, k, index)` decides (index counts this worker's verifies).
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from stoker.common.messages import SpecStats, StepPlan, StepResult, num_ids
from stoker.services.scheduler.request import (
    NO_VERIFY_IN_FLIGHT,
    FinishReason,
    Request,
    RequestStatus,
)
from stoker.services.scheduler.scheduler import Scheduler
from stoker.services.scheduler.speculation import SpecPolicy
from tests import fake_worker
from tests.fake_worker import BS, VOCAB, FakeWorker, _State, req

STOP = 5  # some requests stop on it


def oracle(tokens: Sequence[int]) -> int:
    """The fake target's greedy next token. Mostly it copies the token 3 back (so outputs repeat
    and n-gram proposals are often right), except at every 7th position (so they are sometimes
    wrong): speculation then sees partial acceptance. Never EOS."""
    n = len(tokens)
    if n % 7 and n >= 3:
        return tokens[-3]
    return 1 + (tokens[-1] * 31 + 7 * n) % (VOCAB - 1)


def ngram_reference(tokens: Sequence[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Prompt lookup by brute force: the longest suffix (max_n down to min_n) that occurred
    earlier, most recent occurrence first, and the up to k tokens that followed it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = list(tokens[-n:])
        for i in range(len(tokens) - n - 1, -1, -1):
            if list(tokens[i : i + n]) == suffix:
                return list(tokens[i + n : i + n + k])
    return []


def make(
    method: str | None,
    num_blocks: int = 256,
    cache: bool = True,
    num_tokens: int = 4,
    adaptive: bool = True,
    max_batch: int = 64,
    reqs: Sequence[Request] = (),
    row_cost: float = 0.0,
    ngram_first: bool = False,
    ngram_k: int | None = None,
    **cfg: int,
) -> Scheduler:
    spec = None
    if method is not None:
        spec = SpecPolicy(method, num_tokens, adaptive, max_batch, row_cost, ngram_first, ngram_k)
    return fake_worker.make(num_blocks, cache, reqs, spec, **cfg)


@dataclasses.dataclass
class Verify:
    step_id: int
    req_id: str
    k: int
    accepted: int
    ngram: bool


Accept = Callable[[str, int, int], int]


class SpecFakeWorker(FakeWorker):
    def __init__(
        self,
        mode: str = "oracle",
        seed: int = 0,
        accept: Accept | None = None,
        draft_error: float = 0.3,
    ) -> None:
        super().__init__()
        assert mode in ("oracle", "random", "script")
        assert (mode == "script") == (accept is not None)
        self.mode = mode
        self.rng = random.Random(seed)
        self.accept = accept
        self.draft_error = draft_error  # fake drafter: chance each draft is wrong
        self.verifies: list[Verify] = []

    @staticmethod
    def target(tokens: Sequence[int]) -> int:
        return oracle(tokens)

    def _propose(self, st: _State, k: int) -> list[int]:
        drafts: list[int] = []
        for _ in range(k):
            token = self.target(st.tokens + drafts)
            if self.rng.random() < self.draft_error:
                token = self.rng.randrange(1, VOCAB)
            drafts.append(token)
        return drafts

    def _drafts(self, rid: str, st: _State, num: int, ids: list[int], k: int) -> list[int]:
        if not k:
            assert not ids
            return []
        # A verify: nothing else of this request may be pending.
        assert num == k + 1 and st.computed == len(st.tokens) - 1, (rid, num, k)
        if not ids:
            return self._propose(st, k)
        # n-gram, proposed by the scheduler from the known tokens
        assert len(ids) == k
        assert ngram_reference(st.tokens, k) == ids, (rid, st.tokens, ids)
        return ids

    def _verify(
        self, step_id: int, rid: str, st: _State, drafts: list[int], ngram: bool
    ) -> list[int]:
        k = len(drafts)

        def greedy(accepted: int) -> int:  # the target's token after `accepted` drafts
            return self._next(rid, st, st.tokens + drafts[:accepted])

        if self.mode == "oracle":
            accepted = 0
            while accepted < k and drafts[accepted] == greedy(accepted):
                accepted += 1
        elif self.mode == "random":
            accepted = self.rng.randint(0, k)
        else:
            assert self.accept is not None
            accepted = self.accept(rid, k, len(self.verifies))
            assert 0 <= accepted <= k
        self.verifies.append(Verify(step_id, rid, k, accepted, ngram))
        return drafts[:accepted] + [greedy(accepted)]


# -- the checked driver -----------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    reasons: dict[str, FinishReason] = dataclasses.field(default_factory=dict)
    plans: list[StepPlan] = dataclasses.field(default_factory=list)
    verifies_planned: int = 0
    preempted_during_verify: int = 0
    aborted_during_verify: int = 0
    applied: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    expected_disabled_steps: int = 0


def check_plan(sched: Scheduler, plan: StepPlan, inflight_verifies: set[str]) -> None:
    cfg = sched.config
    run = plan.running
    counts = [n.num_scheduled_tokens for n in plan.new_requests] + run.num_scheduled_tokens
    assert sum(counts) <= cfg.max_num_batched_tokens and all(n >= 1 for n in counts)
    assert plan.num_requests <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
    ids = [n.req_id for n in plan.new_requests] + run.req_ids
    assert len(set(ids)) == len(ids)
    assert not set(ids) & inflight_verifies, "planned a request whose verify is in flight"
    spec = sched.spec
    if spec is None:
        assert not run.spec_token_ids and not run.num_spec_tokens
        return
    assert len(run.spec_token_ids) == len(run.num_spec_tokens) == len(run.req_ids)
    for rid, num, ids_, k in zip(
        run.req_ids, run.num_scheduled_tokens, run.spec_token_ids, run.num_spec_tokens
    ):
        request = sched.requests[rid]
        if not k:
            assert not ids_ and request.spec_inflight == NO_VERIFY_IN_FLIGHT
            continue
        assert 1 <= k <= spec.max_k and num == k + 1
        assert request.spec_inflight == k
        if num_ids(ids_):  # n-gram ids: the ngram method's, or a match under ngram_first
            assert num_ids(ids_) == k and (spec.method == "ngram" or spec.ngram_first)
        else:  # the drafter proposes k itself
            assert spec.method != "ngram" and k <= spec.model_k
        # A verify yields at most k + 1 tokens: within max_tokens and the context length.
        assert request.num_output_tokens + k + 1 <= request.max_tokens
        assert request.num_tokens + k + 1 <= cfg.max_model_len
        assert request.num_placeholders == 1  # the verify itself; nothing else in flight


def check_requests(sched: Scheduler, inflight_verifies: set[str]) -> None:
    sched.blocks.check_invariants()
    for rid, request in sched.requests.items():
        assert request.num_output_tokens <= request.max_tokens
        if request.status == RequestStatus.RUNNING:
            assert request.num_computed_tokens <= request.num_planned_tokens + max(
                request.spec_inflight, 0
            )
            held = len(sched.blocks.block_table(rid)) * BS
            assert request.num_computed_tokens <= held
            assert (request.spec_inflight != NO_VERIFY_IN_FLIGHT) == (rid in inflight_verifies)
        else:
            assert request.spec_inflight == NO_VERIFY_IN_FLIGHT and request.num_placeholders == 0
            assert request.num_computed_tokens == 0 and not sched.blocks.has_seq(rid)


def record(sched: Scheduler, plan: StepPlan, result: StepResult, run: Run) -> None:
    """Apply one result (sched.update) and check what came back. Before that, note which of the
    plan's verifies the scheduler will apply: those whose request is still running (not
    aborted, finished or preempted while the step ran)."""
    num_spec = plan.running.num_spec_tokens or [0] * len(plan.running.req_ids)
    planned_k = dict(zip(plan.running.req_ids, num_spec))
    for row, rid in enumerate(result.req_ids):
        count = 1 if result.counts is None else result.counts[row]
        k = planned_k.get(rid, 0)
        assert 1 <= count <= k + 1
        request = sched.requests.get(rid)
        if request is None or request.status != RequestStatus.RUNNING:
            continue
        assert request.spec_inflight == (k if k else NO_VERIFY_IN_FLIGHT)
        if k:
            run.applied.append((rid, k, count - 1))
    for u in sched.update(plan, result):
        assert u.req_id not in run.reasons, "a token after the finish"
        out = run.outputs.setdefault(u.req_id, [])
        out.extend(u.new_token_ids)
        assert out == u.request.output_token_ids
        request = u.request
        stop_ids = request.stop_ids
        assert not stop_ids & set(out[:-1]), "tokens after a stop token"
        assert len(out) <= request.max_tokens, "max_tokens exceeded"
        if u.finish_reason is not None:
            run.reasons[u.req_id] = u.finish_reason
            assert u.req_id not in sched.requests and not sched.blocks.has_seq(u.req_id)
            if u.finish_reason == FinishReason.STOP:
                assert out[-1] in stop_ids
            elif u.finish_reason == FinishReason.LENGTH:
                assert (
                    len(out) == request.max_tokens
                    or request.num_tokens >= sched.config.max_model_len
                )
        else:
            assert out[-1] not in stop_ids


Hook = Callable[[Scheduler, StepPlan, set[str]], None]


def drive(
    sched: Scheduler,
    worker: SpecFakeWorker,
    overlap: bool,
    hook: Hook | None = None,
    max_steps: int = 5000,
) -> Run:
    """The service's step loop: up to 2 plans in flight with overlap, else strict alternation;
    invariants after every schedule and every update. `hook(sched, plan, inflight)` runs after
    each plan is sent (e.g. to abort requests whose verify is in flight)."""
    run, depth = Run(), 2 if overlap else 1
    for r in sched.requests.values():  # requests driven by hand before keep their outputs
        if r.num_output_tokens:
            run.outputs[r.req_id] = list(r.output_token_ids)
    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    verifying: set[str] = set()
    for _ in range(max_steps):
        if len(inflight) < depth:
            spec = sched.spec
            decoding = sum(1 for r in sched.running if r.num_output_tokens > 0)
            if spec is not None and spec.adaptive and decoding > spec.max_batch:
                run.expected_disabled_steps += 1
            before = set(verifying)
            plan = sched.schedule()
            for rid in before:  # preempted while its verify was in flight
                request = sched.requests.get(rid)
                if request is not None and request.status == RequestStatus.WAITING:
                    run.preempted_during_verify += 1
                    verifying.discard(rid)
            check_plan(sched, plan, verifying)
            run.plans.append(plan)
            k_list = plan.running.num_spec_tokens or [0] * len(plan.running.req_ids)
            for rid, k in zip(plan.running.req_ids, k_list):
                if k:
                    verifying.add(rid)
                    run.verifies_planned += 1
            check_requests(sched, verifying)
            if plan.num_requests or plan.finished_req_ids:
                inflight.append((plan, worker.execute(plan)))  # the worker runs plans in order
                assert not set(plan.finished_req_ids) & worker.reqs.keys()
                if hook is not None:
                    aborted_before = set(sched.requests)
                    hook(sched, plan, verifying)
                    gone = aborted_before - set(sched.requests)
                    run.aborted_during_verify += len(gone & verifying)
                    verifying -= gone
                    check_requests(sched, verifying)
                if plan.num_requests and len(inflight) < depth:
                    continue
        if not inflight:
            return run
        plan, result = inflight.popleft()
        record(sched, plan, result, run)
        verifying -= set(plan.running.req_ids)
        check_requests(sched, verifying)
    raise AssertionError("never went idle")


def random_aborts(seed: int, rate: float) -> Hook:
    """A hook that, after a plan is sent, aborts a request whose verify is in flight with
    probability `rate`."""
    rng = random.Random(seed)

    def hook(sched: Scheduler, plan: StepPlan, verifying: set[str]) -> None:
        if verifying and rng.random() < rate:
            assert sched.abort(rng.choice(sorted(verifying)))

    return hook


def spec_stats(sched: Scheduler) -> SpecStats:
    assert sched.spec is not None
    return sched.spec.stats


def workload(seed: int, n: int = 12) -> list[Request]:
    """Mixed prompts: repetitive ones (n-gram fires from the start), random ones, shared
    prefixes (prefix-cache hits), some stopping on STOP; varied max_tokens."""
    rng = random.Random(seed)
    base = [rng.randrange(1, VOCAB) for _ in range(12)]
    requests = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            unit = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 5))]
            prompt = (unit * 8)[: rng.randrange(6, 20)]
        elif kind == 1:
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 24))]
        else:
            prompt = base[: rng.randrange(4, 13)] + [rng.randrange(1, VOCAB) for _ in range(3)]
        params: dict[str, object] = {}
        if rng.random() < 0.3:
            params["stop_token_ids"] = [STOP]
            prompt[rng.randrange(len(prompt))] = STOP  # the copying oracle may emit it
        requests.append(req(f"q{i}", prompt, rng.randrange(1, 30), **params))
    return requests


def count_proposal_kinds(llm: Any) -> dict[str, int]:
    """Wrap the engine's SpecPolicy.propose: counts of n-gram id lists and model draft counts."""
    spec = llm.engine.scheduler.spec
    counts = {"ngram": 0, "model": 0}
    inner = spec.propose

    def propose(request: Any, k: int) -> Any:
        out = inner(request, k)
        counts["ngram" if isinstance(out, list) and out else "model"] += 1
        return out

    spec.propose = propose
    return counts
