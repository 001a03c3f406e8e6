"""Step telemetry: where each step's time goes, shipped from the scheduler to the api.

The scheduler keeps cumulative histograms (fixed buckets) and sends them whole with each
SchedulerStats, so the message size is independent of the step rate, and the api exposes them
as Prometheus histograms at scrape time.
"""

from __future__ import annotations

import bisect
import collections
import time

import msgspec

# From 10 µs (a scheduler step at batch 1) to 5 s (a long CPU prefill); finer from 25 to
# 500 µs, where a scheduler step at hundreds of running requests falls.
STEP_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.25e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01,
    0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip

STEP_METRICS = {
    "schedule": "Scheduler planning time per step (schedule()).",
    "schedule_cpu": "The scheduler thread's own CPU time in schedule() per step: where processes "
    "share cores, the wall time above also counts time the scheduler was descheduled.",
    "plan_encode": "Scheduler time to encode and send a step plan.",
    "plan_ipc": "Plan transit and decode, from the later of the scheduler's send and the worker "
    "finishing its previous step, to the worker starting the step (a plan queued behind the "
    "step in flight did not wait on IPC).",
    "result_ipc": "Result transit and decode, worker send to scheduler receipt.",
    "update": "Scheduler time to apply a result and publish tokens (update()).",
    "worker_prepare": "Worker input preparation per step.",
    "worker_forward": "Model forward per step on the device: timed with CUDA events on CUDA; on "
    "CPU the forward's wall time (host and device are the same).",
    "worker_forward_host": "Host wall time around the model forward per step: on CUDA the "
    "kernel launches (or one graph replay), on CPU the compute itself.",
    "worker_sample": "Worker sampling per step.",
    "grammar_mask": "Structured outputs: the worker's grammar thread per step with structured "
    "rows (consuming the last tokens and filling the masks), overlapped with the forward.",
    "grammar_wait": "Structured outputs: how long sampling waited for the masks after the "
    "forward, per step with structured rows (the part the forward did not hide).",
    "worker_idle": "Worker idle gap: time it waited for the next plan while there was work "
    "(a wait that began with an engine holding no requests is not counted).",
}


# Forward-pass size per step, in tokens and in requests: powers of two up to 16k.
BATCH_BUCKETS = tuple(float(2**i) for i in range(15))
BATCH_METRICS = {
    "batch_tokens": "Tokens in each step's forward (prefill chunks, decodes and drafts).",
    "batch_requests": "Requests in each step's forward.",
}


def plan_ipc_time(sent_at: float, worker_free_at: float, decoded_at: float) -> float:
    """What a plan's IPC cost the worker (all time.time()): with overlap, plan N+1 arrives while
    step N runs, and the time it sat queued behind that step is not transit."""
    return max(0.0, decoded_at - max(sent_at, worker_free_at))


class HistogramState(msgspec.Struct, array_like=True, gc=False):
    counts: list[int]  # per bucket, non-cumulative; the last is +Inf
    total: float = 0.0

    @classmethod
    def empty(cls) -> HistogramState:
        return cls([0] * (len(STEP_BUCKETS) + 1))

    def observe(self, value: float, buckets: tuple[float, ...] = STEP_BUCKETS, n: int = 1) -> None:
        """n observations of value (n tokens that arrived together share one gap)."""
        self.counts[bisect.bisect_left(buckets, value)] += n
        self.total += value * n


class StepTelemetry(msgspec.Struct, array_like=True, gc=False):
    histograms: dict[str, HistogramState]  # STEP_METRICS, in seconds
    busy_fraction: float = 0.0  # worker busy time / wall time over the last few seconds
    num_steps: int = 0
    batch: dict[str, HistogramState] = {}  # BATCH_METRICS, over BATCH_BUCKETS

    @classmethod
    def empty(cls) -> StepTelemetry:
        return cls(
            {name: HistogramState.empty() for name in STEP_METRICS},
            batch={name: HistogramState([0] * (len(BATCH_BUCKETS) + 1)) for name in BATCH_METRICS},
        )

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def observe_batch(self, num_tokens: int, num_requests: int) -> None:
        self.batch["batch_tokens"].observe(num_tokens, BATCH_BUCKETS)
        self.batch["batch_requests"].observe(num_requests, BATCH_BUCKETS)


class BusyTracker:
    """Rolling fraction of wall time the worker spent in steps."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, busy_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, busy_s))
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def fraction(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        return min(1.0, sum(b for _, b in self._samples) / self.window_s)


class IdleGapAccounting:
    """Which worker waits count as idle gaps. A worker waits for every plan, but a wait that
    began while the engine held no requests is the absence of work, not the host falling
    behind; counting it made one quiet second before a benchmark dominate the idle fraction."""

    def __init__(self) -> None:
        self._engine_idle = True  # nothing has been scheduled yet
        self._after_idle: set[int] = set()

    def engine_idle(self) -> None:
        """The scheduler has no requests and no step in flight."""
        self._engine_idle = True

    def plan_sent(self, step_id: int) -> None:
        if self._engine_idle:
            self._after_idle.add(step_id)
            self._engine_idle = False

    def gap(self, step_id: int, waited_s: float) -> float:
        """The idle gap to record for this step's result."""
        if step_id in self._after_idle:
            self._after_idle.discard(step_id)
            return 0.0
        return waited_s
