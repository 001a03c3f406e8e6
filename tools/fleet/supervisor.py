"""Run a fleet: N `stoker serve` replicas, then `smg launch` and the front (front.py) ahead of
it, and keep them up.

- The replicas start together; the router (smg and the front) starts once they answer /health
  (smg retries a worker that is not up yet only every 30 s, so starting it first would slow the
  first request).
- A replica whose launcher exits (its engine died, say) is started again in the same slot, with
  a backoff if it keeps dying; meanwhile smg's health checks route around it, and it rejoins when
  its /health turns green. smg or the front exiting is fatal: everything stops, exit 1.
- SIGINT / SIGTERM: the router and the replicas are told to stop together (each drains what it
  has in flight, up to --shutdown-timeout), then anything left is killed; exit 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from stoker.common.shutdown import StopSignals, stop_processes
from stoker.tools.fleet.plan import SERVE, FleetPlan, check_replica_argv, plan_fleet

READY_TIMEOUT_S = 300.0
BACKOFF_MAX_S = 30.0
STOP_GRACE_S = 10.0  # past the drain, before a member that will not stop is killed


@dataclass
class Member:
    name: str
    cmd: list[str]
    proc: subprocess.Popen
    started: float
    backoff_s: float = 0.0
    restart_at: float | None = None
    restarts: int = 0


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except Exception:
        return False


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    # Own session: a terminal's Ctrl-C reaches the fleet only, which then stops the members.
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def _log(message: str) -> None:
    print(f"stoker fleet: {message}", file=sys.stderr, flush=True)


def serve_fleet(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser) -> int:
    if args.router is None:
        args.router = "smg"
    run_root = (
        Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="stoker-fleet-"))
    )
    run_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        plan = plan_fleet(args, argv, run_root)
        check_replica_argv(parser, plan.replicas[0].cmd[1 + len(SERVE) :])
    except ValueError as e:
        _log(str(e))
        return 2
    env = _env()
    with StopSignals() as signals:
        started = time.monotonic()
        members = [
            Member(f"replica-{r.index}", r.cmd, _spawn(r.cmd, env), started) for r in plan.replicas
        ]
        try:
            return _run(plan, members, env, started, signals)
        finally:
            # Together: each drains what it has in flight, up to --shutdown-timeout.
            stop_processes([m.proc for m in members], args.shutdown_timeout + STOP_GRACE_S)
            if not args.run_dir:
                shutil.rmtree(run_root, ignore_errors=True)


def _run(
    plan: FleetPlan,
    members: list[Member],
    env: dict[str, str],
    started: float,
    signals: StopSignals,
) -> int:
    replicas = dict(zip((m.name for m in members), plan.replicas, strict=True))
    routers: list[Member] = []  # smg and the front
    announced = False
    while not signals.requested:
        now = time.monotonic()
        for r in routers:
            if r.proc.poll() is not None:
                _log(f"{r.name} exited with code {r.proc.returncode}")
                return 1
        for m in members:
            if m.name in replicas and m.proc.poll() is not None:
                _restart(m, now)
        if not routers:
            if all(_ok(replicas[m.name].url + "/health") for m in members):
                for name, cmd in (("router", plan.router_cmd), ("front", plan.front_cmd)):
                    routers.append(Member(name, cmd, _spawn(cmd, env), now))
                members.extend(routers)
            elif now - started > READY_TIMEOUT_S:
                _log("the replicas did not turn healthy in time")
                return 1
        elif not announced and _ok(plan.router_url + "/readiness"):
            announced = True
            ports = ", ".join(str(r.port) for r in replicas.values())
            _log(
                f"serving on {plan.router_url} via smg, {len(replicas)} replicas on 127.0.0.1 "
                f"ports {ports} (ready in {now - started:.1f}s)"
            )
        time.sleep(0.2)
    return 0


def _restart(m: Member, now: float) -> None:
    """Start a replica again in its slot; one that keeps dying at once backs off (1, 2, 4 ... 30
    s). The backoff is a deadline polled by the main loop, so a signal meanwhile acts at once."""
    if m.restart_at is None:
        _log(f"{m.name} exited with code {m.proc.returncode}")
        if now - m.started > BACKOFF_MAX_S:
            m.backoff_s = 0.0  # it had been running fine
        m.restart_at = now + m.backoff_s
    if now < m.restart_at:
        return
    m.restart_at = None
    m.restarts += 1
    m.backoff_s = min(BACKOFF_MAX_S, m.backoff_s * 2 or 1.0)
    m.proc = _spawn(m.cmd, _env())
    m.started = time.monotonic()
    _log(f"restarted {m.name} (restart {m.restarts})")
