"""Metrics that don't lie (issue 12): queue time counts from the api's arrival, preemptions are a
counter, and a client that goes away counts as a finished request with reason abort."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from stoker.common.addresses import Addresses
from stoker.common.config import EngineConfig
from stoker.common.messages import GenerateRequest, WorkerReady, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.services.scheduler.admission import arrival_monotonic
from stoker.services.scheduler.service import SchedulerService
from tests.factory import make_model
from tests.reliability.serve import Served

# 24 blocks of 16 tokens: four 150-token requests at once cannot all fit, so some are preempted.
FLAGS = ["--num-kv-blocks", "24", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("metrics-model") / "m", "llama")


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    s = Served(model, tmp / "run", tmp / "serve.log", *FLAGS)
    yield s
    s.stop()


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def _value(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


ABORTS = 'stoker:request_success_total{finished_reason="abort"}'
LENGTHS = 'stoker:request_success_total{finished_reason="length"}'


def _wait_value(url: str, sample: str, want: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while (got := _value(_metrics(url), sample)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_client_disconnect_counts_as_abort(served) -> None:
    before = _metrics(served.url)
    aborts, lengths = _value(before, ABORTS), _value(before, LENGTHS)
    body = {"prompt": [9, 10, 11], "max_tokens": 200, "ignore_eos": True, "stream": True}
    chunks = 0
    (worker,) = served.child("worker")
    try:
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks >= 3:
                        # Frozen, the worker finishes no more steps: the stream cannot end by
                        # itself (a "length") before the api sees the disconnect.
                        os.kill(worker, signal.SIGSTOP)
                        break  # the client goes away mid-stream
        assert _wait_value(served.url, ABORTS, aborts + 1) == aborts + 1
    finally:
        os.kill(worker, signal.SIGCONT)
    # A request that runs to its end counts once, under its own reason, and not as an abort.
    done = {"prompt": [9, 10], "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{served.url}/v1/completions", json=done, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    after = _metrics(served.url)
    assert _value(after, LENGTHS) == lengths + 1 and _value(after, ABORTS) == aborts + 1
    served.wait_blocks_free()


def test_preemptions_are_a_counter(served) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 150, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        codes = list(
            pool.map(
                lambda i: (
                    httpx.post(
                        f"{served.url}/v1/completions", json={**body, "seed": i}, timeout=120
                    ).status_code
                ),
                range(4),
            )
        )
    assert codes == [200] * 4
    engine = served.wait_blocks_free()
    assert engine["num_preemptions"] > 0, "the pool was meant to force preemption"
    text = _metrics(served.url)
    assert "# TYPE stoker:num_preemptions_total counter" in text
    assert not re.search(r"^# TYPE stoker:num_preemptions\S* gauge", text, re.M)
    assert _value(text, "stoker:num_preemptions_total") == engine["num_preemptions"]


def test_arrival_on_the_monotonic_clock() -> None:
    assert arrival_monotonic(0.0) is None  # a peer that did not set it: now
    age = 5.0
    got = arrival_monotonic(time.time() - age)
    assert got is not None and time.monotonic() - got >= age
    future = arrival_monotonic(time.time() + 60.0)  # skewed clock: never a negative queue time
    assert future is not None and future <= time.monotonic()


def test_queue_time_starts_at_the_api(model, tmp_path) -> None:
    """The scheduler's queue_s includes what happened before the request reached it."""
    service = SchedulerService(
        EngineConfig(model=str(model), null_model=True), Addresses.in_run_dir(tmp_path / "run")
    )
    try:
        service._start(WorkerReady(num_blocks=16, block_size=16, max_model_len=64, vocab_size=512))
        age = 3.0  # the api took the request this long ago (tokenization, a busy tokenizer)
        msg = GenerateRequest(
            "r-1", pack_ids([5, 6, 7]), SamplingParams(max_tokens=4), time.time() - age
        )
        service._add(b"tok-0", msg)
        assert service.scheduler is not None
        plan = service.scheduler.schedule()
        assert [r.req_id for r in plan.new_requests] == ["r-1"]
        request = service.scheduler.requests["r-1"]
        assert request.first_scheduled_time is not None
        assert request.first_scheduled_time - request.arrival_time >= age
    finally:
        service.ctx.destroy(linger=0)


def test_queue_time_help_says_where_it_starts() -> None:
    from stoker.services.api.metrics import EngineSnapshot, Metrics

    text = Metrics(lambda: EngineSnapshot(None, {})).render().decode()
    help_line = next(
        line for line in text.splitlines() if line.startswith("# HELP stoker:request_queue_time")
    )
    assert "arrival at the api" in help_line


def test_plan_ipc_leaves_out_the_wait_behind_the_step_in_flight() -> None:
    from stoker.common.telemetry import plan_ipc_time

    # Overlap: plan N+1 sent at 10.0 while step N ran until 12.0; decoded 1 ms after.
    assert plan_ipc_time(10.0, 12.0, 12.001) == pytest.approx(0.001)
    # The worker was free first (it waited on the scheduler): the whole transit counts.
    assert plan_ipc_time(12.0, 10.0, 12.003) == pytest.approx(0.003)
    # Clocks a little apart across hosts: never negative.
    assert plan_ipc_time(12.5, 10.0, 12.4) == 0.0


def _steps_settled(url: str, want_requests: float, timeout: float = 20.0) -> str:
    """/metrics once the scheduler's periodic stats carry every step of the request."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(url)
        if _value(text, "stoker:step_batch_requests_sum") >= want_requests:
            return text
        if time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_forward_metrics_count_each_steps_tokens_and_requests(served) -> None:
    """One request alone: its prompt is one prefill step, then one decode step per further
    token, so the per-step batch histograms sum to exactly what the forward ran over."""
    served.wait_blocks_free()
    before = _metrics(served.url)
    names = {
        key: f"stoker:step_{key}" for key in ("batch_tokens_sum", "batch_tokens_count",
                                              "batch_requests_sum", "batch_requests_count")
    }  # fmt: skip
    was = {key: _value(before, name) for key, name in names.items()}
    # 10 prompt tokens: shorter than a block, so nothing comes from the prefix cache.
    body = {"prompt": [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], "max_tokens": 8, "ignore_eos": True}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    after = _steps_settled(served.url, was["batch_requests_sum"] + 8)
    delta = {key: _value(after, name) - was[key] for key, name in names.items()}
    assert delta["batch_tokens_sum"] == 10 + 7  # the last sampled token is never fed back
    assert delta["batch_requests_sum"] == 8 and delta["batch_requests_count"] == 8
    assert delta["batch_tokens_count"] == 8
    assert "# TYPE stoker:step_batch_tokens histogram" in after
    # On CPU the forward is the host's own compute: device time is its wall time, step by step.
    device = _value(after, "stoker:step_worker_forward_seconds_sum")
    host = _value(after, "stoker:step_worker_forward_host_seconds_sum")
    assert device > 0 and device == host
    served.wait_blocks_free()
