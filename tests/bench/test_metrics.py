"""Metrics math of `stoker bench serve` on synthetic timings."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.tools.bench.client import RequestResult
from stoker.tools.bench.metrics import (
    bin_widths,
    compute_metrics,
    format_table,
    output_timeline,
    pct_name,
    peak_concurrency,
    peak_output_throughput,
    summarize,
)


def ok(start: float, ttft: float, latency: float, out: int, prompt: int = 10) -> RequestResult:
    """A successful request whose `out` tokens arrive one per chunk, evenly after the first."""
    gap = (latency - ttft) / (out - 1) if out > 1 else 0.0
    times = [ttft + i * gap for i in range(out)]
    return RequestResult(
        success=True,
        prompt_len=prompt,
        output_tokens=out,
        start=start,
        ttft=ttft,
        latency=latency,
        itl=[b - a for a, b in zip(times, times[1:])],
        chunk_times=times,
    )


RESULTS = [
    ok(0.0, ttft=0.1, latency=1.0, out=10),  # tpot 0.1
    ok(0.5, ttft=0.2, latency=0.8, out=4),  # tpot 0.2
    ok(1.0, ttft=0.3, latency=0.3, out=1),  # no tpot
    RequestResult(success=False, error="HTTP 500", start=1.2, latency=0.1),
]


def test_tpot() -> None:
    assert RESULTS[0].tpot == pytest.approx(0.1)
    assert RESULTS[1].tpot == pytest.approx(0.2)
    assert RESULTS[2].tpot is None and RESULTS[3].tpot is None


def test_compute_metrics() -> None:
    m = compute_metrics(RESULTS, duration=2.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 15
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(7.5)
    assert m["total_token_throughput"] == pytest.approx(22.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300], 99))
    assert m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(150.0)  # requests with >= 2 tokens only
    itls = [100.0] * 9 + [200.0] * 3
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls))
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99))
    assert m["mean_e2el_ms"] == pytest.approx(700.0)
    assert m["max_concurrent_requests"] == 3  # at 1.2 s: requests 2, 3 and the failure
    assert sum(m["output_throughput_timeline"]) == pytest.approx(15.0)  # two full 1 s bins


def test_summarize_empty_is_zero() -> None:
    assert summarize("ttft", [], [99]) == {
        "mean_ttft_ms": 0.0,
        "median_ttft_ms": 0.0,
        "std_ttft_ms": 0.0,
        "p99_ttft_ms": 0.0,
    }
    m = compute_metrics([RequestResult(error="x")], duration=1.0)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0 and m["mean_itl_ms"] == 0.0


def test_pct_name() -> None:
    assert pct_name(99) == "p99" and pct_name(99.0) == "p99" and pct_name(99.9) == "p99.9"


def test_output_timeline_bins() -> None:
    # 10 tokens in [0.1, 1.0]: 9 before t=1 s, one exactly at 1.0 s; 4 tokens in [0.7, 1.3].
    tl = output_timeline(RESULTS[:2], duration=1.3)
    assert len(tl) == 2
    assert tl[0] == pytest.approx(9 + 2)  # request 2's tokens at 0.7 and 0.9
    assert tl[1] == pytest.approx(3 / 0.3)  # a partial last bin is divided by its width
    assert bin_widths(1.3) == pytest.approx([1.0, 0.3])
    # several tokens per chunk: a chunk counts output_tokens / chunks
    r = RequestResult(success=True, output_tokens=6, start=0.0, chunk_times=[0.2, 1.5])
    assert output_timeline([r], duration=2.0) == [3.0, 3.0]


def test_peak_output_throughput() -> None:
    # request 1: 10 tokens in [0.1, 1.0]; request 2: 4 tokens at 0.7, 0.9, 1.1, 1.3
    assert peak_output_throughput(RESULTS, duration=2.0) == pytest.approx(12.0)  # [0.1, 1.1)
    assert peak_output_throughput(RESULTS[1:2], duration=0.5) == pytest.approx(4 / 0.5)
    assert peak_output_throughput(RESULTS[3:], duration=3.0) == 0.0
    # a window may end where the run ends
    late = RequestResult(success=True, output_tokens=3, start=2.0, chunk_times=[0.1, 0.2, 0.3])
    assert peak_output_throughput([late], duration=2.35) == pytest.approx(3.0)


def test_peak_concurrency() -> None:
    back_to_back = [RequestResult(start=0.0, latency=1.0), RequestResult(start=1.0, latency=1.0)]
    assert peak_concurrency(back_to_back) == 1
    nested = [RequestResult(start=s, latency=3.0) for s in (0.0, 0.5, 1.0)]
    assert peak_concurrency(nested) == 3
    assert peak_concurrency([]) == 0


def test_format_table() -> None:
    m = compute_metrics(RESULTS, duration=2.0)
    table = format_table(m, max_concurrency=4, request_rate=float("inf"))
    lines = table.splitlines()
    assert lines[0].strip("=") == " Serving Benchmark Result "
    assert "Successful requests:                     3" in table
    assert "Failed requests:                         1" in table
    assert "Maximum request concurrency:             4" in table
    for label in ("Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "inf"):
        assert label in table
    assert "E2EL" not in table
    assert "P99 E2EL (ms):" in format_table(m, None, 1.0, shown=("e2el",))


def test_sse_lines_survive_chunks_split_anywhere() -> None:
    from stoker.tools.bench.client import sse_data_lines

    stream = b'data: {"a": 1}\n\n: comment\nevent: x\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for size in (1, 2, 3, 7, len(stream)):
        buffer = bytearray()
        got: list[bytes] = []
        for i in range(0, len(stream), size):
            got += sse_data_lines(buffer, stream[i : i + size])
        assert got == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"], size
        assert not buffer
