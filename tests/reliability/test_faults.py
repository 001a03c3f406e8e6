"""Process faults under streaming load, with real processes: a dead tokenizer is restarted and
only its own requests fail; a dead or frozen worker or scheduler ends every stream with an SSE
error event and [DONE], and `stoker serve` exits 1 within seconds (the documented policy:
docs/reliability.md); SIGTERM drains."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.reliability.serve import Served, stream_events

# Long enough that no stream can finish between its first event and the fault: with 40 tokens
# the six streams ended about 0.13 s after their first events, and under a full suite's load
# they once ended before the worker was frozen (no step in flight, so no step timeout).
STREAM = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
NUM_STREAMS = 6


def _streams_with_freeze(server: Served, num: int, then) -> list[list]:
    """Open num streams; once every one has its first event, freeze the worker (so they are
    surely still in flight) and call then(); return each stream's events."""
    (worker,) = server.child("worker")
    started = threading.Barrier(num + 1)

    def one(client: httpx.Client) -> list:
        return stream_events(client, f"{server.url}/v1/completions", STREAM, started.wait)

    with httpx.Client() as client, ThreadPoolExecutor(num) as pool:
        futures = [pool.submit(one, client) for _ in range(num)]
        started.wait(timeout=60)
        os.kill(worker, signal.SIGSTOP)
        try:
            then()
        finally:
            if server.child("worker"):
                os.kill(worker, signal.SIGCONT)
        return [f.result(timeout=60) for f in futures]


def _ended_with_error(events: list, *words: str) -> bool:
    """True if the stream ended with an error event (naming one of words) then [DONE]; False
    if it finished normally. Anything else fails the test."""
    assert events[-1] == "[DONE]", events[-3:]
    errors = [e for e in events[:-1] if isinstance(e, dict) and "error" in e]
    if not errors:
        assert events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        return False
    assert any(w in errors[0]["error"]["message"] for w in words), errors[0]
    assert errors[0]["error"]["type"] == "server_error"
    return True


def _exits_within(server: Served, seconds: float) -> int:
    try:
        return server.proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"stoker serve still running {seconds} s after the fault")


def _wait_log(server: Served, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.logs():
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{server.logs()[-4000:]}"
        time.sleep(0.05)


def _health(server: Served) -> int:
    try:
        return httpx.get(f"{server.url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0  # gone


def test_killed_tokenizer_is_restarted_and_only_its_requests_fail(model, tmp_path):
    server = Served(model, tmp_path / "run", tmp_path / "log", "--tokenizers", "2")
    try:
        victim = sorted(server.state()["tokenizers"].items())[0]  # slot tok-0
        slot, old_pid = victim[0], victim[1]["pid"]
        events = _streams_with_freeze(server, NUM_STREAMS, lambda: os.kill(old_pid, signal.SIGKILL))
        failed = [e for e in events if _ended_with_error(e, f"tokenizer {slot}-")]
        assert len(failed) == NUM_STREAMS // 2  # round robin: half went to the victim
        deadline = time.monotonic() + 60
        while _health(server) != 200 or server.state()["tokenizers"][slot]["pid"] == old_pid:
            assert time.monotonic() < deadline, "the tokenizer was not replaced"
            time.sleep(0.1)
        with ThreadPoolExecutor(4) as pool:  # both tokenizers serve again
            body = {"prompt": [5, 6, 7], "max_tokens": 4}
            url = f"{server.url}/v1/completions"
            results = list(pool.map(lambda _: httpx.post(url, json=body, timeout=60), range(4)))
        assert [r.status_code for r in results] == [200] * 4
        s = server.wait_blocks_free()
        assert s["num_free_blocks"] == s["num_total_blocks"]
        assert "restarted tokenizer-0" in server.logs()
    finally:
        server.stop()


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_killed_engine_process_ends_every_stream_and_serve_exits_1(model, tmp_path, victim):
    server = Served(model, tmp_path / "run", tmp_path / "log")
    health_after: list[int] = []

    def kill() -> None:
        (pid,) = server.child(victim)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (status := _health(server)) == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health_after.append(status)

    try:
        events = _streams_with_freeze(server, NUM_STREAMS, kill)
        # From the api (told by the launcher) or the scheduler (it saw the worker go), whichever
        # reached the stream first.
        lost = ("the engine failed", "the worker was lost")
        assert all(_ended_with_error(e, *lost) for e in events)
        assert health_after[0] in (503, 0)  # unhealthy, then gone
        assert _exits_within(server, 15) == 1
        assert f"{victim} exited with code -9" in server.logs()
    finally:
        server.stop(expect=None)


def test_frozen_worker_is_detected_by_the_step_timeout(model, tmp_path):
    flags = ["--step-timeout-s", "2"]
    server = Served(model, tmp_path / "run", tmp_path / "log", *flags)
    try:
        code: list[int] = []
        # Frozen until stoker serve gives up: the scheduler's step timeout ends the streams.
        events = _streams_with_freeze(
            server, NUM_STREAMS, lambda: code.append(_exits_within(server, 20))
        )
        assert all(_ended_with_error(e, "no progress for 2 s") for e in events)
        assert code == [1]
        assert "scheduler exited with code 3" in server.logs()
    finally:
        server.stop(expect=None)


def test_sigterm_drains_streams_then_ends_the_rest_and_exits_0(model, tmp_path):
    flags = ["--shutdown-timeout", "2"]
    server = Served(model, tmp_path / "run", tmp_path / "log", *flags)
    refused: list[httpx.Response] = []

    def terminate() -> None:
        server.proc.send_signal(signal.SIGTERM)
        # Logged by the api's SIGTERM handler, which runs on the event loop's thread and queues
        # the drain (admission off) ahead of any request that arrives after it.
        _wait_log(server, "shutting down: draining")
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        refused.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=10))
        _wait_log(server, "shutdown: ended")  # past --shutdown-timeout with the worker frozen

    try:
        events = _streams_with_freeze(server, NUM_STREAMS, terminate)
        assert refused[0].status_code == 503 and refused[0].headers["retry-after"] == "1"
        assert refused[0].json()["error"]["code"] == "shutting_down"
        assert all(_ended_with_error(e, "shutting down") for e in events)
    finally:
        server.stop(expect=0)  # no processes left (checked by stop)


def test_sigterm_lets_inflight_streams_finish(model, tmp_path):
    server = Served(model, tmp_path / "run", tmp_path / "log", "--null-model")
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True}
    try:
        with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
            started = threading.Barrier(5)
            url = f"{server.url}/v1/completions"
            futures = [
                pool.submit(stream_events, client, url, body, started.wait) for _ in range(4)
            ]
            started.wait(timeout=60)
            server.proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=60) for f in futures]
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 0
    finally:
        server.stop(expect=0)


def test_repeated_sigterm_while_stopping_still_exits_0(model, tmp_path):
    """A supervisor that repeats SIGTERM (or a user pressing Ctrl-C twice) must not turn a clean
    stop into a kill: the signal is sent every 20 ms until the launcher is gone, through its
    interpreter shutdown, where Python-level handlers are back to the default."""
    server = Served(model, tmp_path / "run", tmp_path / "log", "--null-model")
    try:
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
    finally:
        server.stop(expect=0)
