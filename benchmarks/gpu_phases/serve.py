"""serve: the whole service set on the device: api, tokenizer, scheduler and worker as their own
processes over ZMQ, driven over HTTP (one completion, then `stoker bench serve` at 128 streams,
aiohttp) through benchmarks/serving.py's server handle; no KV block may be leaked at idle."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from gpu_phases.shared import Report, device, dtype_name, model_path, vocab_size


def _http_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def _idle_blocks(server) -> tuple[float, float]:
    """Free and total KV blocks once the scheduler's stats reach the api (its next report)."""
    from serving import metric_sum

    for _ in range(50):
        metrics = server.metrics()
        free = metric_sum(metrics, "stoker:kv_cache_free_blocks")
        total = metric_sum(metrics, "stoker:kv_cache_total_blocks")
        if free == total:
            break
        time.sleep(0.1)
    return free, total


def run(work: Path, smoke: bool, report: Report) -> bool:
    from serving import Server, bench

    flags = ["--device", str(device()), "--dtype", dtype_name(), "--max-model-len", "1024"]
    if smoke:
        flags += ["--max-num-seqs", "8"]
    server = Server(str(model_path(work)), flags, log=work / "serve.log")
    try:
        report.set(ready_s=round(server.ready_s, 1))
        one = _http_json(
            f"http://127.0.0.1:{server.port}/v1/completions",
            dict(prompt="w5 w6 w7", max_tokens=8, temperature=0, ignore_eos=True),
        )
        report.set(completion=one["choices"][0]["text"], usage=one.get("usage"))
        count, streams = (8, 4) if smoke else (512, 128)
        result = bench(server, [
            "--random-input-len", "128", "--random-output-len", "128", "--num-prompts",
            str(count), "--max-concurrency", str(streams), "--metric-percentiles", "50,99",
            "--random-vocab-size", str(vocab_size(work)),
        ])  # fmt: skip
        report.set(bench=result)
        free, total = _idle_blocks(server)
        report.set(kv_free_blocks=free, kv_total_blocks=total)
        print("serve:", {k: v for k, v in report.data.items() if k != "records"})
        return result.get("completed") == count and free == total
    finally:
        server.stop()
