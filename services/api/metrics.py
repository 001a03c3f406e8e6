"""Prometheus metrics for the api, in the process's own registry.

Latencies and token counts are observed here, per request. Engine state (queue sizes, KV blocks,
prefix-cache totals) and per-tokenizer counts come from the latest SchedulerStats / heartbeats,
which already carry cumulative totals, so a custom collector reports them at scrape time instead
of mirroring them into counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from stoker.common.messages import SchedulerStats, SpecStats
from stoker.common.telemetry import (
    BATCH_BUCKETS,
    BATCH_METRICS,
    STEP_BUCKETS,
    STEP_METRICS,
    HistogramState,
    StepTelemetry,
)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
LATENCY_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


# Gauges also exported under vLLM's names, which routers and autoscalers scrape: the Gateway API
# Inference Extension's model-server protocol (TotalQueuedRequests, TotalRunningRequests,
# KVCacheUtilization), llm-d, KEDA recipes. Same values; kv_cache_usage_perc is a 0-1 fraction
# with evictable cached blocks counted free, as in vLLM's block pool (docs/kv-events.md).
VLLM_ALIASES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")


@dataclass
class EngineSnapshot:
    stats: SchedulerStats | None
    tokenizer_requests: dict[str, int]  # tokenizer id -> requests it admitted (cumulative)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        s = snap.stats
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s and s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s and s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (0-1).", s and s.kv_usage),
            "kv_cache_free_blocks": ("Free KV-cache blocks.", s and s.num_free_blocks),
            "kv_cache_total_blocks": ("KV-cache blocks in total.", s and s.num_total_blocks),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"stoker:{name}", doc, value=float(value or 0))
            if name in VLLM_ALIASES:
                alias_doc = f"{doc} Alias of stoker:{name}."
                yield GaugeMetricFamily(f"vllm:{name}", alias_doc, value=float(value or 0))
        # vLLM's older name for the same fraction, which SMG 1.13's load monitor (its KV
        # overload threshold and cache-aware balance) still reads.
        yield GaugeMetricFamily(
            "vllm:gpu_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1). Alias of stoker:kv_cache_usage_perc, "
            "under vLLM's deprecated name.",
            value=float((s and s.kv_usage) or 0),
        )
        # A counter (rate() works across scrapes), fed by the scheduler's cumulative count.
        yield CounterMetricFamily(
            "stoker:num_preemptions",
            "Requests preempted (their KV blocks taken back) since the scheduler started.",
            value=float(s.num_preemptions if s else 0),
        )
        yield CounterMetricFamily(
            "stoker:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=float(s.prefix_queries if s else 0),
        )
        yield CounterMetricFamily(
            "stoker:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            value=float(s.prefix_hits if s else 0),
        )
        per_tokenizer = CounterMetricFamily(
            "stoker:tokenizer_requests",
            "Requests admitted by each tokenizer process.",
            labels=["tokenizer"],
        )
        for tok_id, n in sorted(snap.tokenizer_requests.items()):
            per_tokenizer.add_metric([tok_id], float(n))
        yield per_tokenizer
        yield from _step_metrics(s.telemetry if s else None)
        yield from _spec_metrics(s.spec if s else None)


def _spec_metrics(spec: SpecStats | None) -> Iterator[Metric]:
    """Speculative decoding counters (vLLM's names, stoker: prefix); absent when it is off."""
    if spec is None:
        return
    counters = {
        "num_drafts": ("Verify steps run for a request.", spec.drafts),
        "num_draft_tokens": ("Draft tokens proposed.", spec.draft_tokens),
        "num_accepted_tokens": ("Draft tokens accepted.", spec.accepted_tokens),
        "disabled_steps": ("Steps where adaptive speculation was off (batch too large).",
                           spec.disabled_steps),
        "paused_drafts": ("Request-steps that sat out drafts for low acceptance (adaptive).",
                          spec.paused_drafts),
    }  # fmt: skip
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(f"stoker:spec_decode_{name}", doc, value=float(value))
    per_pos = CounterMetricFamily(
        "stoker:spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens by position in the draft.",
        labels=["position"],
    )
    for position, count in enumerate(spec.accepted_per_position):
        per_pos.add_metric([str(position)], float(count))
    yield per_pos
    mean = (spec.accepted_tokens + spec.drafts) / spec.drafts if spec.drafts else 0.0
    yield GaugeMetricFamily(
        "stoker:spec_decode_mean_acceptance_length",
        "Tokens produced per verify step (accepted drafts + 1), since start.",
        value=mean,
    )


def _step_metrics(telemetry: StepTelemetry | None) -> Iterator[Metric]:
    """The scheduler's cumulative step histograms, re-exposed as Prometheus histograms."""
    telemetry = telemetry or StepTelemetry.empty()
    for name, doc in STEP_METRICS.items():
        state = telemetry.histograms[name]
        yield _histogram(f"stoker:step_{name}_seconds", doc, state, STEP_BUCKETS)
    empty = StepTelemetry.empty().batch
    for name, doc in BATCH_METRICS.items():
        state = telemetry.batch.get(name) or empty[name]  # absent: an older scheduler
        yield _histogram(f"stoker:step_{name}", doc, state, BATCH_BUCKETS)
    yield GaugeMetricFamily(
        "stoker:device_busy_fraction",
        "Fraction of recent wall time the worker spent running steps.",
        value=telemetry.busy_fraction,
    )
    yield CounterMetricFamily("stoker:steps", "Steps run by the worker.", value=telemetry.num_steps)


def _histogram(
    name: str, doc: str, state: HistogramState, bounds: tuple[float, ...]
) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), state.counts):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=state.total)


class _TokenCollector(Collector):
    """The per-token series, kept as plain numbers by Metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        yield _histogram(
            "stoker:inter_token_latency_seconds",
            "Time between output tokens of one request.",
            m.itl,
            LATENCY_BUCKETS,
        )
        yield CounterMetricFamily(
            "stoker:generation_tokens", "Generated tokens.", value=m.generation_tokens
        )


class Metrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "stoker:time_to_first_token_seconds",
            "Time from arrival at the api to the first output token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Per token, so not prometheus_client's (a lock and a bucket scan per observation, a
        # sixth of the api's CPU at 70k tokens/s): plain counts, exported at scrape time.
        self.itl = HistogramState([0] * (len(LATENCY_BUCKETS) + 1))
        self.generation_tokens = 0
        self.e2e = Histogram(
            "stoker:e2e_request_latency_seconds",
            "Time from arrival at the api to the last output token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "stoker:request_queue_time_seconds",
            "Time from arrival at the api to the request's first step (tokenization and the "
            "scheduler's queue).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "stoker:prompt_tokens", "Prompt tokens of finished prefills.", registry=r
        )
        self.request_success = Counter(
            "stoker:request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        # Structured outputs (docs/structured-outputs.md), per structured request.
        self.grammar_compile = Histogram(
            "stoker:grammar_compile_seconds",
            "Grammar compile time in the tokenizer process, for compiles the cache did not answer.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grammar_compiles = Counter(
            "stoker:grammar_compiles",
            "Structured requests admitted, by whether the compile cache answered.",
            ["cache"],
            registry=r,
        )
        self.grammar_mask = Histogram(
            "stoker:grammar_mask_seconds",
            "A structured request's share of the worker's grammar-mask time, over its life.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grammar_forced_tokens = Counter(
            "stoker:grammar_forced_tokens",
            "Tokens a grammar forced, proposed as drafts and accepted (fast-forward): each "
            "saved a forward pass.",
            registry=r,
        )
        r.register(_EngineCollector(snapshot))
        r.register(_TokenCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)
