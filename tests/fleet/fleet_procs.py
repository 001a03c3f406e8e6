"""Run `stoker serve --replicas N --router smg` for a test, and take it down leaving nothing."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from stoker.tools.fleet.workload import PrefixCounters, prefix_counters
from tests.deploy.procs import alive, children_of

MODEL = "stoker-tiny"


def free_port_run(n: int) -> int:
    """The first of n consecutive free loopback ports (the fleet numbers replicas upwards)."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


def process_tree(pid: int) -> list[int]:
    out = [pid]
    for kid in children_of(pid):
        out += process_tree(kid)
    return out


@dataclass
class Fleet:
    proc: subprocess.Popen
    port: int
    replica_ports: list[int]
    metrics_port: int
    run_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.replica_ports[i]}"

    def replica_pid(self, i: int) -> int:
        """The replica's own `stoker serve` launcher, a direct child of the fleet."""
        want = f"--port {self.replica_ports[i]} "
        for kid in children_of(self.proc.pid):
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "cli serve" in cmdline and want in cmdline + " ":
                return kid
        raise LookupError(f"replica {i} is not running")

    def counters(self, i: int) -> PrefixCounters:
        return prefix_counters(httpx.get(self.replica_url(i) + "/metrics", timeout=5).text)

    def total(self) -> PrefixCounters:
        total = PrefixCounters(0.0, 0.0)
        for i in range(len(self.replica_ports)):
            total = total + self.counters(i)
        return total


def answers_200(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the fleet exited with {proc.returncode} waiting for {what}")
        if check():
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} not within {timeout}s")


def start_fleet(
    run_dir: Path, replicas: int, extra: Sequence[str] = (), model: str = MODEL, null: bool = True
) -> Fleet:
    # The front on port, the replicas after it, then smg's own port, then its metrics port.
    port = free_port_run(replicas + 3)
    metrics_port = port + replicas + 2
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", model]
    cmd += ["--null-model"] if null else []
    cmd += ["--replicas", str(replicas), "--router", "smg", "--port", str(port)]
    cmd += ["--router-metrics-port", str(metrics_port), "--run-dir", str(run_dir), *extra]
    proc = subprocess.Popen(cmd, start_new_session=True)
    fleet = Fleet(proc, port, [port + 1 + i for i in range(replicas)], metrics_port, run_dir)
    try:
        wait_until(lambda: workers_healthy(fleet) == replicas, 240, "the fleet", proc)
    except BaseException:
        stop_fleet(fleet)
        raise
    return fleet


def workers(fleet: Fleet) -> list[dict]:
    return httpx.get(fleet.url + "/workers", timeout=5).json()["workers"]


def workers_healthy(fleet: Fleet) -> int:
    if not answers_200(fleet.url + "/readiness"):
        return 0
    return sum(1 for w in workers(fleet) if w["is_healthy"] and w["status"] == "ready")


def stop_fleet(fleet: Fleet) -> int:
    """SIGTERM the fleet; returns its exit code once no process of it is left."""
    tree = process_tree(fleet.proc.pid)
    if fleet.proc.poll() is None:
        fleet.proc.send_signal(signal.SIGTERM)
    try:
        code = fleet.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in reversed(process_tree(fleet.proc.pid)):
            os.kill(pid, signal.SIGKILL)
        fleet.proc.wait()
        raise
    deadline = time.monotonic() + 10
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in tree if alive(p)]
    assert not left, f"processes outlived the fleet: {left}"
    return code
