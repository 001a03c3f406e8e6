"""/metrics after traffic, /v1/models, /health, /debug/state."""

from __future__ import annotations

import time

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


def _total(m: dict[str, dict[tuple, float]], name: str, labels: tuple = ()) -> float:
    return m.get(name, {}).get(labels, 0.0)


def _tokenizer_total(m: dict[str, dict[tuple, float]]) -> float:
    return sum(m.get("stoker:tokenizer_requests_total", {}).values())


def _settled(server) -> dict[str, dict[tuple, float]]:
    """A snapshot whose per-tokenizer counts have caught up: they come with the tokenizers'
    0.5 s heartbeat, so the previous test's requests can land in them after its responses (seen
    on a loaded box: a before-snapshot short by two). Settled once a heartbeat later they have not
    moved."""
    m = _samples(server)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        time.sleep(0.6)
        again = _samples(server)
        if _tokenizer_total(again) == _tokenizer_total(m):
            return again
        m = again
    return m


def test_metrics_after_traffic(server):
    """The session-wide server has served other tests' traffic, so counters are compared before
    and after two requests of a known shape; they must move by exactly what those produce."""
    # Two requests with the same 3-block prompt (no other test sends it): the second one hits
    # the prefix cache for its 3 full blocks.
    prompt = [(i * 7) % 500 + 3 for i in range(3 * server.block_size + 5)]
    server.wait_idle(5.0)
    before = _settled(server)
    for _ in range(2):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        assert (
            httpx.post(f"{server.base_url}/completions", json=body, timeout=30).status_code == 200
        )
    length = (("finished_reason", "length"),)
    expected = {
        ("stoker:prompt_tokens_total", ()): 2 * len(prompt),
        ("stoker:generation_tokens_total", ()): 12,
        ("stoker:prefix_cache_queries_total", ()): 2 * (len(prompt) - 1),
        ("stoker:prefix_cache_hits_total", ()): 3 * server.block_size,
        ("stoker:request_success_total", length): 2,
        ("stoker:time_to_first_token_seconds_count", ()): 2,
        ("stoker:e2e_request_latency_seconds_count", ()): 2,
        ("stoker:request_queue_time_seconds_count", ()): 2,
    }

    def deltas(m) -> dict[tuple[str, tuple], float]:
        return {k: _total(m, *k) - _total(before, *k) for k in expected}

    # Engine counters come with the scheduler's stats and tokenizer counts with the 0.5 s
    # heartbeat, after the responses: poll for them rather than read once.
    deadline = time.monotonic() + 10.0
    while True:
        server.wait_idle(1.0)
        m = _samples(server)
        served = _tokenizer_total(m) - _tokenizer_total(before)
        if (deltas(m) == expected and served == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert deltas(m) == expected
    assert served == 2

    for name in HISTOGRAMS:
        count = _total(m, f"{name}_count") - _total(before, f"{name}_count")
        total = _total(m, f"{name}_sum") - _total(before, f"{name}_sum")
        assert 0 <= total < max(count, 1) * 60, name
    # One observation per token after each request's first delta (which may carry several).
    itl = "stoker:inter_token_latency_seconds_count"
    assert 1 <= _total(m, itl) - _total(before, itl) <= 10
    for name in GAUGES:
        assert () in m[name], name
    assert m["stoker:kv_cache_total_blocks"][()] == server.num_kv_blocks
    assert m["stoker:kv_cache_free_blocks"][()] == server.num_kv_blocks
    assert m["stoker:num_requests_running"][()] == 0
    assert 0 <= m["stoker:kv_cache_usage_perc"][()] <= 1
    tokenizers = m["stoker:tokenizer_requests_total"]
    assert {dict(k)["tokenizer"] for k in tokenizers} == {"tok-0", "tok-1"}


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


def test_requests_with_and_without_logprobs_share_steps(server):
    """Requests that ask for logprobs and requests that do not, decoding in the same steps,
    all complete with what they asked for (a step's None rows once broke the token batch)."""
    import concurrent.futures

    def one(i: int) -> dict:
        body = {"prompt": [5 + i, 6, 7], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        if i % 2 == 0:
            body["logprobs"] = 2
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
        assert r.status_code == 200
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    for i, out in enumerate(outs):
        assert out["usage"]["completion_tokens"] == 16
        logprobs = out["choices"][0]["logprobs"]
        assert (logprobs is not None and len(logprobs["token_logprobs"]) == 16) == (i % 2 == 0)
