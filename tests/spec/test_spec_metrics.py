"""SpecStats (and the /metrics exposition built from it) agree with what actually happened.

Sans-IO: a scripted fake worker decides every verify's acceptance, so the expected counters are
known exactly. Offline engine: the worker's plans and results are recorded, and the counters are
recomputed from them (k per verify from the plan, accepted = tokens returned - 1).

Counting rule (scheduler): a verify is counted when its result is applied; a verify whose
request was aborted, finished or preempted while it ran is dropped and not counted.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from stoker.common.messages import SchedulerStats, SpecStats, StepPlan, StepResult
from stoker.services.api.metrics import EngineSnapshot, Metrics
from stoker.services.engine import LLM, SamplingParams
from tests.fake_worker import assert_idle
from tests.spec.fakes import (
    SpecFakeWorker,
    drive,
    make,
    random_aborts,
    spec_stats,
    workload,
)
from tests.spec.spec_models import SpecModels

pytestmark = pytest.mark.timeout(300)  # a broken verify can loop forever
CFG = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "max_model_len": 56}


def expected_stats(
    verifies: Sequence[tuple[str, int, int]], max_k: int, disabled_steps: int
) -> SpecStats:
    """SpecStats for these (request, k, accepted) verifies."""
    return SpecStats(
        drafts=len(verifies),
        draft_tokens=sum(k for _, k, _ in verifies),
        accepted_tokens=sum(a for _, _, a in verifies),
        accepted_per_position=[sum(a > j for _, _, a in verifies) for j in range(max_k)],
        disabled_steps=disabled_steps,
    )


def scripted(seed: int) -> Callable[[str, int, int], int]:
    """Accept a fixed pseudo-random number of drafts per verify (all of 0..k occur)."""
    rng = random.Random(seed)
    return lambda rid, k, index: rng.randint(0, k)


# -- sans-IO: a scripted fake worker ----------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stats_equal_scripted_acceptance(method: str) -> None:
    """Strict steps, no aborts or preemption: every verify the worker ran is applied."""
    for seed in range(3):
        sched = make(method, reqs=workload(seed), **CFG)
        worker = SpecFakeWorker("script", accept=scripted(seed))
        run = drive(sched, worker, overlap=False)
        ran = [(v.req_id, v.k, v.accepted) for v in worker.verifies]
        assert run.applied == ran and len(ran) == run.verifies_planned > 0
        assert sched.spec is not None
        assert sched.spec.stats == expected_stats(ran, 4, 0)
        assert all(v.ngram == (method == "ngram") for v in worker.verifies)
        assert_idle(sched, worker)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_dropped_verifies_are_not_counted(method: str) -> None:
    """Overlap, a tiny pool (preemption while a verify runs) and aborts of verifying requests:
    the counters equal the applied verifies, and some verifies were dropped."""
    dropped = 0
    for seed in range(4):
        sched = make(method, 12, reqs=workload(seed), **CFG)
        worker = SpecFakeWorker("script", accept=scripted(seed))
        run = drive(sched, worker, overlap=True, hook=random_aborts(seed, 0.1))
        assert sched.spec is not None
        assert sched.spec.stats == expected_stats(run.applied, 4, 0)
        assert len(worker.verifies) >= len(run.applied)
        dropped += len(worker.verifies) - len(run.applied)
        assert_idle(sched, worker)
    assert dropped > 0


def test_disabled_steps_count_steps_over_max_batch() -> None:
    """max_batch 2 with up to 4 running requests: disabled_steps counts exactly the steps
    planned while more than 2 requests were running, and drafts still happen in the others."""
    sched = make("draft", reqs=workload(5), max_batch=2, **CFG)
    worker = SpecFakeWorker("script", accept=scripted(5))
    run = drive(sched, worker, overlap=True)
    assert sched.spec is not None
    stats = sched.spec.stats
    assert stats.disabled_steps == run.expected_disabled_steps > 0
    assert stats == expected_stats(run.applied, 4, run.expected_disabled_steps)
    assert stats.drafts > 0
    assert_idle(sched, worker)


def test_accepted_per_position_is_monotone_and_bounded() -> None:
    """Position j is accepted only if every position before it was: the per-position counts
    never increase with j, and position 0 counts verifies with at least one accepted draft."""
    sched = make("draft", reqs=workload(1), **CFG)
    worker = SpecFakeWorker("script", accept=scripted(1))
    run = drive(sched, worker, overlap=False)
    assert sched.spec is not None
    per_pos = sched.spec.stats.accepted_per_position
    assert per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] == sum(a > 0 for _, _, a in run.applied) <= sched.spec.stats.drafts


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name}{labels} not exposed"
    return float(match.group(1))


def test_prometheus_exposition_matches_stats() -> None:
    """The /metrics counters are the scheduler's SpecStats; the mean acceptance length is the
    number of tokens a verify produced on average (accepted + 1)."""
    sched = make("ngram", reqs=workload(2), row_cost=1.0, **CFG)  # some requests sit out
    run = drive(sched, SpecFakeWorker("script", accept=scripted(2)), overlap=False)
    assert sched.spec is not None
    stats = sched.spec.stats
    assert stats.paused_drafts > 0
    snapshot = SchedulerStats(
        worker_ready=True,
        num_running=0,
        num_waiting=0,
        num_free_blocks=sched.blocks.num_free_blocks(),
        num_total_blocks=sched.blocks.num_blocks,
        kv_usage=0.0,
        prefix_queries=sched.prefix_queries,
        prefix_hits=sched.prefix_hits,
        num_preemptions=sched.num_preemptions,
        max_model_len=sched.config.max_model_len,
        model_name="fake",
        spec=stats,
    )
    text = Metrics(lambda: EngineSnapshot(snapshot, {})).render().decode()
    assert _metric(text, "stoker:spec_decode_num_drafts_total") == stats.drafts
    assert _metric(text, "stoker:spec_decode_num_draft_tokens_total") == stats.draft_tokens
    assert _metric(text, "stoker:spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert _metric(text, "stoker:spec_decode_disabled_steps_total") == stats.disabled_steps
    assert _metric(text, "stoker:spec_decode_paused_drafts_total") == stats.paused_drafts
    for j, count in enumerate(stats.accepted_per_position):
        name = "stoker:spec_decode_num_accepted_tokens_per_pos_total"
        assert _metric(text, name, f'{{position="{j}"}}') == count
    produced = sum(a + 1 for _, _, a in run.applied) / len(run.applied)
    mean = _metric(text, "stoker:spec_decode_mean_acceptance_length")
    assert mean == pytest.approx(produced)


# -- the offline engine -----------------------------------------------------------------------


def observe(llm: LLM) -> list[tuple[StepPlan, StepResult]]:
    """Record every (plan, result) the engine's worker handles."""
    log: list[tuple[StepPlan, StepResult]] = []
    runner = llm.engine.runner
    inner = runner.execute

    def execute(plan: StepPlan) -> StepResult:
        result = inner(plan)
        log.append((plan, result))
        return result

    runner.execute = execute  # type: ignore[method-assign]
    return log


def observed_verifies(log: list[tuple[StepPlan, StepResult]]) -> list[tuple[str, int, int]]:
    """(request, k, accepted) of every verify, from the plans (k) and results (tokens - 1)."""
    verifies = []
    for plan, result in log:
        num_spec = plan.running.num_spec_tokens or [0] * len(plan.running.req_ids)
        k_of = {r: k for r, k in zip(plan.running.req_ids, num_spec) if k}
        counts = result.counts or [1] * len(result.req_ids)
        for rid, count in zip(result.req_ids, counts):
            if rid in k_of:
                assert 1 <= count <= k_of[rid] + 1
                verifies.append((rid, k_of[rid], count - 1))
        assert set(k_of) <= set(result.req_ids), "a verify returned no tokens"
    return verifies


def count_disabled(llm: LLM) -> list[int]:
    """Counts schedule() calls made while more than max_batch requests were running."""
    sched = llm.engine.scheduler
    assert sched.spec is not None
    counter = [0]
    inner = sched.schedule

    def schedule() -> StepPlan:
        if sched.spec is not None and len(sched.running) > sched.spec.max_batch:
            counter[0] += 1
        return inner()

    sched.schedule = schedule  # type: ignore[method-assign]
    return counter


def engine_prompts() -> list[list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 7, 15, 30, 44)]
    for unit_len in (2, 3, 4, 5, 6):
        unit = [rng.randrange(3, 500) for _ in range(unit_len)]
        prompts.append((unit * 10)[: 4 * unit_len + 1])
    return prompts


def run_engine(models: SpecModels, method: str, **options: Any) -> tuple[LLM, list, list[int]]:
    spec: dict[str, Any] = {"speculative": "ngram"}
    if method != "ngram":
        spec = {"speculative": "draft", "speculative_model": str(models.draft(method))}
    # Row cost 0: no request sits drafts out, so every kind of verify is counted here
    # (test_spec_scheduler.py covers the pausing); the draft's own proposals only.
    options = {"speculative_row_cost": 0.0, "speculative_ngram_first": False, **options}
    llm = LLM(str(models.target), num_kv_blocks=256, **spec, **options)
    log = observe(llm)
    disabled = count_disabled(llm)
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6 + 3 * i)
        for i in range(len(engine_prompts()))
    ]
    llm.generate(engine_prompts(), params)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks
    return llm, observed_verifies(log), disabled


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_self_draft_accepts_everything(
    spec_models: Callable[[str], SpecModels], arch: str
) -> None:
    """The target as its own draft: accepted_tokens == draft_tokens, and accepted_per_position[j]
    is the number of verifies with k > j."""
    llm, verifies, disabled = run_engine(spec_models(arch), "self", speculative_max_batch=4)
    stats = spec_stats(llm.engine.scheduler)
    assert verifies and all(a == k for _, k, a in verifies)
    assert stats.accepted_tokens == stats.draft_tokens == sum(k for _, k, _ in verifies)
    assert stats.drafts == len(verifies)
    for j in range(4):
        assert stats.accepted_per_position[j] == sum(k > j for _, k, _ in verifies)
    assert stats.disabled_steps == disabled[0] > 0
    assert stats == expected_stats(verifies, 4, disabled[0])


@pytest.mark.parametrize("method", ["ngram", "noisy", "1layer"])
def test_engine_stats_equal_observed_verifies(
    spec_models: Callable[[str], SpecModels], method: str
) -> None:
    """Partial acceptance from real models: the counters equal the verifies the worker ran."""
    llm, verifies, disabled = run_engine(spec_models("llama"), method)
    stats = spec_stats(llm.engine.scheduler)
    assert verifies
    max_k = llm.engine.config.num_speculative_tokens  # per method: 8 for n-gram, else 4
    assert max_k is not None
    assert stats == expected_stats(verifies, max_k, disabled[0])
    assert disabled[0] > 0  # 10 requests > max_batch 8 at first
    if method != "1layer":
        assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_engine_fixed_k_is_never_switched_off(spec_models: Callable[[str], SpecModels]) -> None:
    """Adaptive off: no step is switched off even with 10 requests running, and each verify
    proposes K drafts unless max_tokens leaves less room."""
    llm, verifies, _ = run_engine(spec_models("llama"), "noisy", speculative_adaptive=False)
    stats = spec_stats(llm.engine.scheduler)
    assert stats == expected_stats(verifies, 4, 0)
    ks = [k for _, k, _ in verifies]
    assert ks.count(4) > 0.8 * len(ks)
