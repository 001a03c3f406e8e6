"""`stoker serve` (or its processes one by one) run for real, with helpers to hurt them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.deploy.procs import alive, children_of, free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
# Tests never wait on a native kernel build (another session may hold its lock); the torch
# reference kernels are exact.
ENV = dict(os.environ, HF_HUB_OFFLINE="1", STOKER_LOG_LEVEL="WARNING", STOKER_CPU_KERNELS="0")


class Served:
    """One `stoker serve` and its children."""

    def __init__(self, model: Path, run_dir: Path, log: Path, *flags: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", str(model)]
        cmd += ["--port", str(self.port), "--run-dir", str(run_dir), *flags]
        self.log_path = log
        self._log = open(log, "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env={**ENV, **env}, stdout=self._log, stderr=subprocess.STDOUT
        )
        wait_healthy(f"{self.url}/health", procs=[self.proc])
        # The launcher announces readiness when its own 0.2 s poll sees /health: wait for that
        # too, or a test that stops the server at once can miss the launcher's line (seen
        # under a full suite's load in tests/observability/test_json_logs.py).
        deadline = time.monotonic() + 30
        while "(ready in " not in self.logs() and self.proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.children = children_of(self.proc.pid)

    def child(self, module: str) -> list[int]:
        """pids of the live children running `services.<module>`."""
        out = []
        for pid in children_of(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"stoker.services.{module}".encode() in cmdline.split(b"\0"):
                out.append(pid)
        return out

    def state(self, headers: dict | None = None) -> dict:
        return httpx.get(f"{self.url}/debug/state", headers=headers, timeout=5).json()

    def wait_blocks_free(self, timeout: float = 10.0, headers: dict | None = None) -> dict:
        """Poll until nothing runs or waits and free == total KV blocks; return the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state(headers)["scheduler"]
            done = s["num_running"] == 0 and s["num_waiting"] == 0
            if done and s["num_free_blocks"] == s["num_total_blocks"]:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def logs(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, expect: int | None = 0, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        finally:
            self._log.close()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in self.children if alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, "child processes outlived stoker serve"
        if expect is not None:
            assert code == expect, f"stoker serve exited with {code}:\n{self.logs()[-4000:]}"
        return code


def stream_events(client: httpx.Client, url: str, body: dict, on_first=None) -> list:
    """POST a streaming request; return its SSE events (dicts, and the string "[DONE]")."""
    events: list = []
    with client.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        if r.status_code != 200:
            return [("status", r.status_code, json.loads(r.read()))]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append("[DONE]" if data == "[DONE]" else json.loads(data))
            if len(events) == 1 and on_first is not None:
                on_first()
    return events
