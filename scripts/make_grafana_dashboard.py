"""Write deploy/grafana/dashboards/stoker.json: the fleet dashboard, one panel per question an
operator asks (load, latency, queueing, KV cache, speculation, where a step's time goes, load per
tokenizer). Generated so the PromQL lives in one readable list; run it after editing PANELS.

    .venv/bin/python scripts/make_grafana_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "stoker.json"
DS = {"type": "prometheus", "uid": "stoker-prometheus"}


def q(level: float, name: str) -> str:
    return f"histogram_quantile({level}, sum by (le) (rate({name}_bucket[1m])))"


def mean(name: str) -> str:
    return f"rate({name}_sum[1m]) / rate({name}_count[1m])"


STEP_PHASES = ["schedule", "plan_ipc", "worker_prepare", "worker_forward", "worker_sample"]
STEP_PHASES += ["result_ipc", "update", "worker_idle"]

# Is the host keeping the device fed? The device's share of the worker's time while it has work:
# forward device time over the worker's wall time per step (waiting for a plan, preparing,
# issuing the forward, sampling). Near 1: fed; lower: the host is the bottleneck.
DEVICE_FED = (
    "rate(stoker:step_worker_forward_seconds_sum[1m]) / ("
    + " + ".join(
        f"rate(stoker:step_worker_{p}_seconds_sum[1m])"
        for p in ("idle", "prepare", "forward_host", "sample")
    )
    + ")"
)

# (title, unit, [(legend, expr)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests per second", "reqps", [("finished", "sum(rate(stoker:request_success_total[1m]))")]),
    ("Output tokens per second", "short", [("tok/s", "rate(stoker:generation_tokens_total[1m])")]),
    (
        "Time to first token",
        "s",
        [("p50", q(0.5, "stoker:time_to_first_token_seconds")),
         ("p99", q(0.99, "stoker:time_to_first_token_seconds"))],
    ),
    (
        "Inter-token latency",
        "s",
        [("p50", q(0.5, "stoker:inter_token_latency_seconds")),
         ("p99", q(0.99, "stoker:inter_token_latency_seconds"))],
    ),
    (
        "Running and waiting requests",
        "short",
        [("running", "stoker:num_requests_running"), ("waiting", "stoker:num_requests_waiting")],
    ),
    ("KV cache usage", "percentunit", [("used", "stoker:kv_cache_usage_perc")]),
    (
        "Prefix-cache hit rate",
        "percentunit",
        [("hits / queried tokens",
          "rate(stoker:prefix_cache_hits_total[5m])"
          " / rate(stoker:prefix_cache_queries_total[5m])")],
    ),
    (
        "Speculative acceptance",
        "percentunit",
        [("accepted / drafted",
          "rate(stoker:spec_decode_num_accepted_tokens_total[5m])"
          " / rate(stoker:spec_decode_num_draft_tokens_total[5m])")],
    ),
    (
        "Step time split (mean per step)",
        "s",
        [(phase, mean(f"stoker:step_{phase}_seconds")) for phase in STEP_PHASES],
    ),
    ("Device busy fraction", "percentunit", [("busy", "stoker:device_busy_fraction")]),
    ("Device fed share (forward device time / worker time)", "percentunit", [("fed", DEVICE_FED)]),
    (
        "Forward time per step: device and host",
        "s",
        [("device", mean("stoker:step_worker_forward_seconds")),
         ("host", mean("stoker:step_worker_forward_host_seconds"))],
    ),
    (
        "Forward batch per step (mean)",
        "short",
        [("tokens", mean("stoker:step_batch_tokens")),
         ("requests", mean("stoker:step_batch_requests"))],
    ),
    (
        "Requests per tokenizer",
        "reqps",
        [("{{tokenizer}}", "rate(stoker:tokenizer_requests_total[1m])")],
    ),
]  # fmt: skip


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + j), "datasource": DS, "expr": expr, "legendFormat": legend}
            for j, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    return {
        "uid": "stoker",
        "title": "stoker",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "tags": ["stoker", "llm-serving"],
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
