"""A tokenizer that dies or stalls must not leave its requests hanging: the api addresses each
request to one tokenizer, and fails the requests of a tokenizer silent for LOST_S (or restarted
under a new pid) with a 503, aborting them upstream."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from stoker.common.addresses import Addresses
from stoker.common.config import DEFAULT_MODEL
from stoker.services.api import engine_client
from stoker.services.api.engine_client import EngineClient, _Tokenizer, _Track
from tests.deploy.procs import CLI, free_port, service_env, stop_all, wait_healthy


def _client() -> EngineClient:
    client = EngineClient(Addresses.in_run_dir("/nonexistent"), num_tokenizers=2)
    client.aborts = []
    client._send_abort = client.aborts.extend  # no sockets in this test
    return client


def test_requests_of_silent_or_restarted_tokenizers_fail_with_503():
    client = _client()
    now = 1000.0
    client.tokenizers = {
        "tok-a": _Tokenizer(pid=11, requests_served=1, last_seen=now - engine_client.LOST_S - 1),
        "tok-b": _Tokenizer(pid=22, requests_served=1, last_seen=now),
        "tok-c": _Tokenizer(pid=34, requests_served=1, last_seen=now),  # restarted: was 33
    }
    queues = {name: asyncio.Queue() for name in ("r1", "r2", "r3")}
    client._tracks = {
        "r1": _Track(queues["r1"], now, tokenizer="tok-a", tokenizer_pid=11),
        "r2": _Track(queues["r2"], now, tokenizer="tok-b", tokenizer_pid=22),
        "r3": _Track(queues["r3"], now, tokenizer="tok-c", tokenizer_pid=33),
    }
    assert sorted(client.fail_lost_tokenizers(now)) == ["r1", "r3"]
    for name in ("r1", "r3"):
        delta = queues[name].get_nowait()
        assert delta.error_status == 503 and delta.finish_reason == "abort"
        assert "stopped responding" in delta.error
    assert queues["r2"].empty() and list(client._tracks) == ["r2"]
    assert sorted(client.aborts) == ["r1", "r3"] and {"r1", "r3"} <= set(client._aborted)
    assert "tok-a" not in client.tokenizers  # forgotten; tok-c (alive, new pid) stays
    assert sorted(client.tokenizers) == ["tok-b", "tok-c"]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _taken(base: str) -> dict[str, int]:
    """The requests each tokenizer (by slot) has taken, as of its last heartbeat."""
    with urllib.request.urlopen(f"{base}/debug/state", timeout=5) as resp:
        return {slot: t["requests"] for slot, t in json.loads(resp.read())["tokenizers"].items()}


@pytest.mark.skipif(
    not (DEFAULT_MODEL / "config.json").exists(), reason="the bundled model is not built"
)
def test_a_stalled_tokenizer_fails_its_requests_and_the_others_serve(tmp_path):
    """Real processes: four requests go out while the worker is frozen (none can finish); once
    each of the two tokenizers has taken two, one is frozen (SIGSTOP keeps its sockets open, so
    the api cannot tell it from a busy one) and the worker goes on: the two requests the frozen
    one holds come back as 503s once it has been silent for LOST_S, the other two complete;
    later requests succeed. (Freezing the tokenizer before sending raced its staleness: the api
    routes only to tokenizers heard from within STALE_S, 2 s, of each request.)"""
    port = free_port()
    env = {**service_env(tmp_path), "STOKER_TOKENIZER_LOST_S": "2"}
    model = str(DEFAULT_MODEL)
    py = CLI
    cmds = [
        [*py, "worker", "--model", model],
        [*py, "scheduler", "--model", model],
        [*py, "tokenizer", "--model", model, "--id", "tok-a"],
        [*py, "tokenizer", "--model", model, "--id", "tok-b"],
        [*py, "api", "--model", model, "--port", str(port), "--num-tokenizers", "2"],
    ]
    procs = [subprocess.Popen(c, env=env) for c in cmds]
    worker, stalled = procs[0], procs[2]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{base}/health", procs=procs)
        body = {"model": "stoker-tiny", "prompt": [5, 6, 7], "max_tokens": 8}
        want = {slot: n + 2 for slot, n in _taken(base).items()}  # round robin: two each
        worker.send_signal(signal.SIGSTOP)
        with ThreadPoolExecutor(4) as pool:
            try:
                futures = [pool.submit(_post, f"{base}/v1/completions", body) for _ in range(4)]
                deadline = time.monotonic() + 30
                while (taken := _taken(base)) != want:
                    assert time.monotonic() < deadline, (taken, want)
                    time.sleep(0.05)
                stalled.send_signal(signal.SIGSTOP)
            finally:
                worker.send_signal(signal.SIGCONT)
            results = [f.result() for f in futures]
        statuses = sorted(status for status, _ in results)
        assert statuses == [200, 200, 503, 503], results
        lost = [out for status, out in results if status == 503]
        for out in lost:  # tok-a's incarnation: tok-a-<8 hex digits>
            message = out["error"]["message"]
            assert "tokenizer tok-a-" in message and "stopped responding" in message, out
        for _ in range(3):  # tok-a is forgotten: everything goes to tok-b
            status, out = _post(f"{base}/v1/completions", body)
            assert status == 200 and out["usage"]["completion_tokens"] == 8
    finally:
        stalled.send_signal(signal.SIGCONT)
        stop_all(procs)
