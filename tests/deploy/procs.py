"""Helpers for tests that run stoker's processes for real."""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "stoker.cli"]  # one stoker service: CLI + [name, args...]


def service_env(run_dir: str | Path) -> dict[str, str]:
    """The environment for a set of stoker services started one by one, talking over sockets in
    run_dir, offline."""
    from stoker.common.addresses import Addresses

    return {**os.environ, "HF_HUB_OFFLINE": "1", **Addresses.in_run_dir(str(run_dir)).to_env()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"process {p.args} exited with {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def children_of(pid: int) -> list[int]:
    """Direct children of pid, read from /proc (Linux)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def post_json(url: str, body: bytes) -> dict:
    import json

    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def stop_all(procs, timeout: float = 20.0) -> None:
    """SIGTERM every process still running, then wait; one that will not stop is killed and
    the test fails (a service that ignores SIGTERM is a bug)."""
    import signal
    import subprocess

    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR2)  # its threads' stacks go to stderr (common/logs.py)
            time.sleep(1.0)
            p.kill()
            raise
