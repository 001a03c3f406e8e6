"""Benchmark metrics from per-request timings, with the same names as `vllm bench serve`.

Token counts and latencies cover successful requests only. TPOT is per request,
(e2e - ttft) / (output_tokens - 1), for requests with at least two output tokens; ITL pools the
gaps between content chunks of all requests. Latency statistics are in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from stoker.tools.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
LABELS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def pct_name(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (vLLM's key spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict:
    """mean/median/std/percentiles of `values_s` (seconds) in ms; zeros when there are none."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[f"{pct_name(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def bin_widths(duration: float, bin_s: float = 1.0) -> list[float]:
    """Widths of the timeline's bins: full `bin_s` bins, the last one cut at `duration`."""
    nbins = max(1, math.ceil(duration / bin_s))
    return [bin_s] * (nbins - 1) + [max(duration - (nbins - 1) * bin_s, 1e-9)]


def token_times(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """When output tokens arrived (seconds since the benchmark started, sorted) and how many:
    a chunk's tokens are the request's output tokens spread evenly over its chunks."""
    times: list[float] = []
    weights: list[float] = []
    for r in results:
        if r.success and r.chunk_times:
            times.extend(r.start + t for t in r.chunk_times)
            weights.extend([r.output_tokens / len(r.chunk_times)] * len(r.chunk_times))
    order = np.argsort(times, kind="stable")
    return np.asarray(times, dtype=np.float64)[order], np.asarray(weights, dtype=np.float64)[order]


def output_timeline(
    results: Sequence[RequestResult], duration: float, bin_s: float = 1.0
) -> list[float]:
    """Output tokens per second in consecutive `bin_s` windows since the benchmark started
    (the last, partial window divided by its own width)."""
    widths = bin_widths(duration, bin_s)
    times, weights = token_times(results)
    edges = [i * bin_s for i in range(len(widths) + 1)]
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return (counts / np.asarray(widths)).tolist()


def peak_output_throughput(
    results: Sequence[RequestResult], duration: float, window_s: float = 1.0
) -> float:
    """Most output tokens in any `window_s` sliding window within the run, per second (the
    whole run's rate when it is shorter than one window)."""
    times, weights = token_times(results)
    if duration <= window_s or times.size == 0:
        return float(weights.sum()) / max(duration, 1e-9)
    cum = np.concatenate([[0.0], np.cumsum(weights)])
    # a best window can always start at a token, or end where the run ends
    starts = np.append(times[times <= duration - window_s], duration - window_s)
    lo = np.searchsorted(times, starts, side="left")
    hi = np.searchsorted(times, starts + window_s, side="left")
    return float((cum[hi] - cum[lo]).max()) / window_s


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (failed ones included: they held a slot too)."""
    events = sorted(
        [(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    peak = live = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Iterable[float] = (99,),
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    timeline = output_timeline(results, duration)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": peak_output_throughput(results, duration),
        "max_concurrent_requests": peak_concurrency(results),
    }
    percentiles = list(percentiles)
    for name in METRICS:
        out.update(summarize(name, values[name], percentiles))
    out["output_throughput_timeline"] = timeline
    return out


def format_table(
    m: dict[str, Any],
    max_concurrency: int | None,
    request_rate: float,
    percentiles: Sequence[float] = (99,),
    shown: Sequence[str] = ("ttft", "tpot", "itl"),
) -> str:
    """The result table, laid out like vLLM's."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
        lines.append(fmt.format(label, value if isinstance(value, float) else str(value)))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Maximum request concurrency:", max_concurrency)
    row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name in shown:
        title, short = LABELS[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{pct_name(p)[1:]} {short} (ms):", m[f"{pct_name(p)}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
