"""`stoker serve` as a user runs it: starts everything, answers, shuts down cleanly on SIGTERM
with no child left, and exits non-zero naming the child if one dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.procs import alive, children_of, free_port, post_json, wait_healthy
from tests.factory import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("serve") / "model", "llama")


PER_POS = "stoker:spec_decode_num_accepted_tokens_per_pos_total"


def _metrics(url: str) -> dict[str, float]:
    """Sample name (with its labels as written) -> value."""
    import urllib.request

    with urllib.request.urlopen(url) as resp:
        text = resp.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _start(model, tmp_path, port):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--tokenizers", "2", "--run-dir", str(run_dir)]
    cmd += ["--num-kv-blocks", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_healthy(f"http://127.0.0.1:{port}/health", procs=[proc])
    return proc, run_dir


def test_serve_answers_and_sigterm_leaves_nothing_behind(model, tmp_path):
    port = free_port()
    proc, run_dir = _start(model, tmp_path, port)
    try:
        kids = children_of(proc.pid)
        assert len(kids) == 5  # worker, scheduler, 2 tokenizers, api
        base = os.getpriority(os.PRIO_PROCESS, 0)
        for kid in kids:  # the front end yields the CPU to the engine (--frontend-nice 10)
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
            engine = b"stoker.services.worker" in cmdline or b"stoker.services.scheduler" in cmdline
            want = base if engine else min(base + 10, 19)
            assert os.getpriority(os.PRIO_PROCESS, kid) == want, cmdline
        body = json.dumps({"model": model.name, "prompt": [5, 6, 7], "max_tokens": 4})
        out = post_json(f"http://127.0.0.1:{port}/v1/completions", body.encode())
        assert out["usage"]["completion_tokens"] == 4
        line = proc.stdout.readline()
        assert f"serving {model} on http://127.0.0.1:{port}" in line
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 5
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "child processes outlived stoker serve"
    assert not run_dir.exists(), "the run directory (ipc sockets) was left behind"


def test_dead_child_is_named_and_serve_exits_nonzero(model, tmp_path):
    port = free_port()
    proc, _ = _start(model, tmp_path, port)
    kids = children_of(proc.pid)
    worker = next(
        k for k in kids if b"stoker.services.worker" in Path(f"/proc/{k}/cmdline").read_bytes()
    )
    os.kill(worker, signal.SIGKILL)
    assert proc.wait(timeout=30) == 1
    assert "worker exited with code -9" in proc.stderr.read()
    deadline = time.monotonic() + 5
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)]


def test_a_kv_pool_beyond_free_memory_fails_fast_with_the_flag(model, tmp_path):
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(free_port()), "--run-dir", str(tmp_path / "run")]
    cmd += ["--kv-cache-memory-gb", "100000"]  # 100 TB: more than any machine running this
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "lower --kv-cache-memory-gb" in proc.stderr
    assert "worker exited with code 1" in proc.stderr


def test_null_model_runs_the_whole_pipeline_and_exports_step_telemetry(model, tmp_path):
    import asyncio

    from openai import AsyncOpenAI

    port = free_port()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", str(model), "--null-model"]
    cmd += ["--port", str(port), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", procs=[proc])
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")

        async def one(i: int) -> int:
            stream = await client.completions.create(
                model=model.name,
                prompt=[5 + i, 6, 7],
                max_tokens=64,
                stream=True,
                extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            )
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            return usage.completion_tokens

        async def many() -> list[int]:
            return await asyncio.gather(*(one(i) for i in range(32)))

        assert asyncio.run(many()) == [64] * 32
        # Stats arrive periodically: poll until the last step's result is counted.
        deadline = time.monotonic() + 10.0
        while True:
            m = _metrics(f"http://127.0.0.1:{port}/metrics")
            steps = m.get("stoker:steps_total", 0.0)
            settled = m.get("stoker:generation_tokens_total") == 32 * 64 and steps == m.get(
                "stoker:step_worker_forward_seconds_count"
            )
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # What 32 streams of 3-token prompts and 64 tokens each must produce.
        assert m["stoker:generation_tokens_total"] == 32 * 64
        assert m["stoker:prompt_tokens_total"] == 32 * 3
        assert m['stoker:request_success_total{finished_reason="length"}'] == 32
        # One sampled token per request per step (no speculation): at least 64 steps, at
        # most one per token; each result is timed once in every worker-side histogram.
        assert 64 <= steps <= 32 * 64
        for name in ("update", "plan_ipc", "result_ipc", "worker_prepare", "worker_forward"):
            assert m[f"stoker:step_{name}_seconds_count"] == steps, name
        assert m["stoker:step_worker_sample_seconds_count"] == steps
        assert m["stoker:step_worker_idle_seconds_count"] == steps
        # Every plan is timed once when planned and once when sent; each result answers one.
        assert m["stoker:step_schedule_seconds_count"] == m["stoker:step_plan_encode_seconds_count"]
        assert m["stoker:step_schedule_seconds_count"] >= steps
        assert 0.0 <= m["stoker:device_busy_fraction"] <= 1.0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


GREEDY_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], list(range(20, 50))]


def _greedy_texts(model: Path, run_dir: Path, flags: list[str], check=None) -> list[str]:
    """Start `stoker serve` with flags, complete GREEDY_PROMPTS (24 tokens each), call
    check(port) while it is up, and stop it with SIGTERM (which must exit 0)."""
    port = free_port()
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--run-dir", str(run_dir), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", procs=[proc])
        body = {"model": model.name, "prompt": None, "max_tokens": 24, "temperature": 0}
        texts = []
        for prompt in GREEDY_PROMPTS:
            body["prompt"] = prompt
            out = post_json(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode())
            texts.append(out["choices"][0]["text"])
        if check is not None:
            check(port)
        return texts
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def reference_texts(model, tmp_path_factory):
    """The default server's (overlap on, no speculation) greedy texts, served once per module."""
    return _greedy_texts(model, tmp_path_factory.mktemp("reference"), [])


def _speculation_metrics_add_up(port: int) -> None:
    # Scheduler stats reach /metrics periodically: read one snapshot that has them all, then
    # check it against itself.
    deadline = time.monotonic() + 10.0
    while True:
        m = _metrics(f"http://127.0.0.1:{port}/metrics")
        done = m.get("stoker:generation_tokens_total") == 24 * len(GREEDY_PROMPTS)
        drafted = m.get("stoker:spec_decode_num_drafts_total", 0) > 0
        if (done and drafted) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m["stoker:spec_decode_num_drafts_total"] > 0
    accepted = m["stoker:spec_decode_num_accepted_tokens_total"]
    assert 0 <= accepted <= m["stoker:spec_decode_num_draft_tokens_total"]
    per_pos = [v for k, v in m.items() if k.startswith(PER_POS)]
    assert sum(per_pos) == accepted  # each accepted draft counted at its position


@pytest.mark.parametrize(
    "flags",
    [
        ["--no-overlap"],
        ["--speculative", "ngram"],
        pytest.param(["--speculative", "ngram", "--no-overlap"], marks=pytest.mark.slow),
    ],
    ids=["no-overlap", "ngram", "ngram-no-overlap"],
)
def test_greedy_outputs_identical_across_overlap_and_speculation(
    model, reference_texts, tmp_path, flags
):
    """Every mode produces the default server's greedy tokens; speculation shows in /metrics."""
    check = _speculation_metrics_add_up if "ngram" in flags else None
    assert _greedy_texts(model, tmp_path, flags, check) == reference_texts
