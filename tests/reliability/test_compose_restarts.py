"""Compose-style restarts: the services run as separate processes (as compose runs them), and
each one in turn is killed and started again with the same command, as `restart:
unless-stopped` does. A request in flight when the worker or scheduler dies fails at once with
a 503, and the set serves again without a restart of the others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from stoker.common.addresses import Addresses
from tests.deploy.procs import free_port, stop_all, wait_healthy
from tests.reliability.serve import ENV, REPO


def _serves(url: str, n: int = 2) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    for _ in range(n):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


def _serves_again(url: str, timeout: float = 60.0) -> None:
    """Until the set has noticed the restart, a request may get a 503 (with Retry-After):
    retry as a client should, then require plain success."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4}
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        except httpx.TransportError:  # the api itself is restarting
            r = None
        if r is not None and r.status_code == 200:
            break
        assert r is None or r.status_code == 503, r.text
        assert time.monotonic() < deadline, "the set did not serve again"
        time.sleep(0.2)
    _serves(url)


BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


def _wait_inflight(url: str) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/debug/state", timeout=5).json()["api_inflight"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _blocks_free(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        s = httpx.get(f"{url}/debug/state", timeout=5).json()["scheduler"]
        if s["num_free_blocks"] == s["num_total_blocks"] and not s["num_running"]:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_each_process_restarts_alone_and_the_set_serves_again(model, tmp_path):
    port = free_port()
    env = {**ENV, **Addresses.in_run_dir(str(tmp_path / "run")).to_env()}
    py = [sys.executable, "-m", "stoker.cli"]
    m = ["--model", str(model)]
    cmds = {
        "worker": [*py, "worker", *m, "--null-model"],
        "scheduler": [*py, "scheduler", *m, "--null-model"],
        "tokenizer": [*py, "tokenizer", *m],
        "api": [*py, "api", *m, "--port", str(port)],
    }
    procs = {name: subprocess.Popen(cmd, cwd=REPO, env=env) for name, cmd in cmds.items()}
    url = f"http://127.0.0.1:{port}"
    pool = ThreadPoolExecutor(1)
    try:
        wait_healthy(f"{url}/health", procs=list(procs.values()))
        _serves(url)
        for name in ("worker", "scheduler", "tokenizer", "api"):
            inflight = None
            if name in ("worker", "scheduler"):  # with a request held in flight (worker frozen)
                os.kill(procs["worker"].pid, signal.SIGSTOP)
                inflight = pool.submit(httpx.post, f"{url}/v1/completions", json=BODY, timeout=60)
                _wait_inflight(url)
            procs[name].kill()
            procs[name].wait()
            if name == "scheduler":
                os.kill(procs["worker"].pid, signal.SIGCONT)
            if inflight is not None:  # failed at once by the death, not by a timeout
                r = inflight.result(timeout=30)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["type"] == "server_error"
            procs[name] = subprocess.Popen(cmds[name], cwd=REPO, env=env)
            _serves_again(url)
            _blocks_free(url)
        tokenizers = httpx.get(f"{url}/debug/state", timeout=5).json()["tokenizers"]
        assert len(tokenizers) == 1  # the restarted one replaced its predecessor at once
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        stop_all(list(procs.values()))
        pool.shutdown()
