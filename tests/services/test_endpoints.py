"""/metrics after traffic, /v1/models, /health, /debug/state."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = [
    "stoker:time_to_first_token_seconds",
    "stoker:inter_token_latency_seconds",
    "stoker:e2e_request_latency_seconds",
    "stoker:request_queue_time_seconds",
]
GAUGES = [
    "stoker:num_requests_running",
    "stoker:num_requests_waiting",
    "stoker:kv_cache_usage_perc",
    "stoker:kv_cache_free_blocks",
    "stoker:kv_cache_total_blocks",
]
COUNTERS = [
    "stoker:prefix_cache_queries",
    "stoker:prefix_cache_hits",
    "stoker:prompt_tokens",
    "stoker:generation_tokens",
    "stoker:request_success",
    "stoker:tokenizer_requests",
]


def _samples(server) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}}."""
    out: dict[str, dict[tuple, float]] = {}
    r = httpx.get(f"{server.url}/metrics", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_after_traffic(server):
    # Two requests with the same 3-block prompt: the second hits the prefix cache.
    prompt = [(i * 7) % 500 + 3 for i in range(3 * server.block_size + 5)]
    for _ in range(2):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        assert (
            httpx.post(f"{server.base_url}/completions", json=body, timeout=30).status_code == 200
        )
    server.wait_idle(1.0)
    m = _samples(server)

    for name in HISTOGRAMS:
        count = m[f"{name}_count"][()]
        assert count > 0, name
        assert 0 <= m[f"{name}_sum"][()] < count * 60, name
    assert m["stoker:inter_token_latency_seconds_count"][()] >= 10
    for name in GAUGES:
        assert () in m[name], name
    assert m["stoker:kv_cache_total_blocks"][()] == server.num_kv_blocks
    assert m["stoker:kv_cache_free_blocks"][()] == server.num_kv_blocks
    assert m["stoker:num_requests_running"][()] == 0
    assert 0 <= m["stoker:kv_cache_usage_perc"][()] <= 1
    assert m["stoker:prompt_tokens_total"][()] >= 2 * len(prompt)
    assert m["stoker:generation_tokens_total"][()] >= 12
    assert m["stoker:prefix_cache_queries_total"][()] >= 2 * (len(prompt) - 1)
    assert m["stoker:prefix_cache_hits_total"][()] >= 3 * server.block_size
    success = m["stoker:request_success_total"]
    assert success[(("finished_reason", "length"),)] >= 2
    tokenizers = m["stoker:tokenizer_requests_total"]
    assert {dict(k)["tokenizer"] for k in tokenizers} == {"tok-0", "tok-1"}
    assert sum(tokenizers.values()) >= 2


def test_models(server):
    r = httpx.get(f"{server.base_url}/models", timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [server.model_name]
    assert body["data"][0]["object"] == "model"


def test_health_and_debug_state(server):
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    state = httpx.get(f"{server.url}/debug/state", timeout=5).json()
    sched = state["scheduler"]
    assert sched["worker_ready"] is True
    assert sched["num_total_blocks"] == server.num_kv_blocks
    assert {"num_running", "num_waiting", "num_free_blocks"} <= set(sched)
    assert set(state["tokenizers"]) == {"tok-0", "tok-1"}
