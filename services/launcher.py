"""`stoker serve`: start api, N tokenizers, scheduler and worker as processes, and supervise them.

Policy when a child dies: stoker does not restart it. A dead worker or scheduler loses every
request's KV state, and a half-restarted pipeline would silently drop streams, so the launcher
says which process died (and its exit code), stops the rest and exits non-zero. Run it under a
supervisor (compose `restart: unless-stopped`, systemd) for restarts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from common.addresses import Addresses
from services.engine_args import add_engine_args, engine_args_to_argv

HEALTH_TIMEOUT_S = 300.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="stoker serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024)
    parser.add_argument("--no-overlap", action="store_true", help="disable overlap scheduling")
    parser.add_argument(
        "--frontend-nice",
        type=int,
        default=10,
        choices=range(20),
        metavar="0..19",
        help="niceness added to the api and tokenizer processes (0: same as the engine)",
    )
    parser.add_argument("--run-dir", default=None, help="where ipc sockets live (default: temp)")
    add_engine_args(parser)
    return parser


def _commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    py = [sys.executable, "-m"]
    engine = engine_args_to_argv(args)
    scheduler = py + ["services.scheduler", *engine]
    if args.no_overlap:
        scheduler.append("--no-overlap")
    api = py + [
        "services.api",
        "--model", args.model,
        "--host", args.host,
        "--port", str(args.port),
        "--num-tokenizers", str(args.tokenizers),
        "--max-request-bytes", str(args.max_request_bytes),
    ]  # fmt: skip
    if args.served_model_name:
        api += ["--served-model-name", args.served_model_name]
    if args.max_model_len:
        api += ["--max-model-len", str(args.max_model_len)]
    tokenizer = py + ["services.tokenizer", "--model", args.model]
    if args.max_model_len:
        tokenizer += ["--max-model-len", str(args.max_model_len)]
    cmds = [("worker", py + ["services.worker", *engine]), ("scheduler", scheduler)]
    cmds += [(f"tokenizer-{i}", tokenizer + ["--id", f"tok-{i}"]) for i in range(args.tokenizers)]
    cmds.append(("api", api))
    return cmds


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except Exception:
        return False


def serve(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="stoker-")
    env = dict(os.environ, STOKER_RUN_DIR=run_dir, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(Addresses.in_run_dir(run_dir).to_env())
    children: list[Child] = []
    stopping = False

    def on_signal(signum: int, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    exit_code = 0
    try:
        for name, cmd in _commands(args):
            # Own process group per child: a terminal Ctrl-C reaches only the launcher, which then
            # stops the children in order, so none is left behind.
            # The api and tokenizers yield the CPU to the worker and scheduler, the step's
            # critical path: on a box with fewer cores than busy processes, a front-end process
            # preempting a worker thread stalls the whole step (docs/benchmarks.md, 32 streams).
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            if args.frontend_nice and (name == "api" or name.startswith("tokenizer")):
                base = os.getpriority(os.PRIO_PROCESS, 0)
                os.setpriority(os.PRIO_PROCESS, proc.pid, min(base + args.frontend_nice, 19))
            children.append(Child(name, proc))
        health = f"http://{args.host}:{args.port}/health"
        announced = False
        while not stopping:
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                for c in dead:
                    print(f"stoker: {c.name} exited with code {c.proc.returncode}", file=sys.stderr)
                exit_code = 1
                break
            if not announced:
                if _healthy(health):
                    announced = True
                    took = time.monotonic() - started
                    print(
                        f"stoker: serving {args.model} on http://{args.host}:{args.port} "
                        f"(ready in {took:.1f}s)",
                        flush=True,
                    )
                elif time.monotonic() - started > HEALTH_TIMEOUT_S:
                    print("stoker: /health did not turn green in time", file=sys.stderr)
                    exit_code = 1
                    break
            time.sleep(0.2)
    finally:
        _stop_all(children)
        shutil.rmtree(run_dir, ignore_errors=True)
    return exit_code


def _stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    for c in reversed(children):  # api first, so no new work arrives while the rest stop
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()


def main(argv: list[str] | None = None) -> int:
    return serve(build_parser().parse_args(argv))
