"""`stoker serve`: start api, N tokenizers, scheduler and worker as processes, and supervise them.

Policy when a child dies (docs/reliability.md):
- a tokenizer is stateless beyond its own requests: it is restarted at once (as a new
  incarnation), only its own in-flight requests fail, and the others keep serving;
- the worker or scheduler holds every request's KV state: the launcher tells the api (SIGUSR1),
  which fails every request in flight with an error and turns /health 503 at once, then stops the
  rest and exits 1 within seconds, so a supervisor (systemd, compose) restarts the set;
- the api: stop the rest and exit 1.
On SIGTERM the api drains first (--shutdown-timeout), then the engine stops; exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from common.addresses import Addresses, private_dir
from common.logs import add_log_format_arg, configure_logging
from services.api.__main__ import add_request_log_args, add_safety_args
from services.engine_args import add_engine_args, engine_args_to_argv
from services.fleet.plan import add_fleet_args, wants_fleet

HEALTH_TIMEOUT_S = 300.0
ENGINE = ("worker", "scheduler")
FAIL_GRACE_S = 1.0  # after telling the api the engine died: time to send the errors out
RESTART_BACKOFF_S = 1.0  # a tokenizer that dies again at once waits this long (doubling, <=30)
log = logging.getLogger("stoker.launcher")


def _say(message: str, level: int = logging.WARNING, to_stdout: bool = False) -> None:
    """The launcher's own news: `stoker: ...` lines as always, or JSON with --log-format json."""
    if os.environ.get("STOKER_LOG_FORMAT") == "json":
        log.log(level, message)
    else:
        print(f"stoker: {message}", file=sys.stdout if to_stdout else sys.stderr, flush=True)


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen
    restarts: int = 0
    backoff_s: float = 0.0
    started: float = 0.0
    restart_at: float | None = None  # a dead tokenizer waiting out its backoff


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
    parser.add_argument(
        "--run-dir", default=None, help="where ipc sockets live (default: a private temp dir)"
    )
    add_safety_args(parser)
    add_request_log_args(parser)
    add_engine_args(parser)
    add_log_format_arg(parser)
    add_fleet_args(parser)
    return parser


def _commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    py = [sys.executable, "-m"]
    engine = engine_args_to_argv(args)
    scheduler = py + ["services.scheduler", *engine, "--step-timeout-s", str(args.step_timeout_s)]
    if args.no_overlap:
        scheduler.append("--no-overlap")
    api = py + [
        "services.api",
        "--model", args.model,
        "--host", args.host,
        "--port", str(args.port),
        "--num-tokenizers", str(args.tokenizers),
        "--max-request-bytes", str(args.max_request_bytes),
        "--max-n", str(args.max_n),
        "--max-queued-requests", str(args.max_queued_requests),
        "--shutdown-timeout", str(args.shutdown_timeout),
        "--step-timeout-s", str(args.step_timeout_s),
    ]  # fmt: skip
    if args.request_timeout_s is not None:
        api += ["--request-timeout-s", str(args.request_timeout_s)]
    if args.protect_metrics:
        api.append("--protect-metrics")
    if args.log_requests:
        api += ["--log-requests", os.path.abspath(args.log_requests)]
        api += ["--log-requests-max-bytes", str(args.log_requests_max_bytes)]
        api += ["--log-requests-max-files", str(args.log_requests_max_files)]
        if args.log_requests_text:
            api.append("--log-requests-text")
    if args.profile_dir:  # the worker and scheduler get it with the engine flags
        api += ["--profile-dir", os.path.abspath(args.profile_dir)]
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
    if args.run_dir:
        run_dir = str(private_dir(args.run_dir))
    else:
        run_dir = tempfile.mkdtemp(prefix="stoker-")  # 0700, ours
    env = dict(os.environ, STOKER_RUN_DIR=run_dir, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(Addresses.in_run_dir(run_dir).to_env())
    if args.api_key:  # by environment, not argv: the command line is world-readable in /proc
        env["STOKER_API_KEY"] = args.api_key
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
            children.append(Child(name, cmd, _spawn(name, cmd, env, args.frontend_nice)))
        health = f"http://{args.host}:{args.port}/health"
        announced = False
        while not stopping:
            dead = [c for c in children if c.proc.poll() is not None]
            fatal = [c for c in dead if not c.name.startswith("tokenizer")]
            for c in dead:
                if c.restart_at is None:  # said once, not on every poll of its backoff
                    _say(f"{c.name} exited with code {c.proc.returncode}")
            if fatal:
                if any(c.name in ENGINE for c in fatal):
                    _engine_lost(children)
                exit_code = 1
                break
            for c in dead:  # tokenizers: a new incarnation in the same slot
                _restart(c, env, args.frontend_nice, time.monotonic())
            if not announced:
                if _healthy(health):
                    announced = True
                    took = time.monotonic() - started
                    _say(
                        f"serving {args.model} on http://{args.host}:{args.port} "
                        f"(ready in {took:.1f}s)",
                        logging.INFO,
                        to_stdout=True,
                    )
                elif time.monotonic() - started > HEALTH_TIMEOUT_S:
                    _say("/health did not turn green in time", logging.ERROR)
                    exit_code = 1
                    break
            time.sleep(0.2)
    finally:
        _stop_all(children, drain_s=args.shutdown_timeout if exit_code == 0 else 0.0)
        shutil.rmtree(run_dir, ignore_errors=True)
        # Stopped: a repeated SIGTERM or Ctrl-C has nothing left to do. Ignored, not left to
        # on_signal, because interpreter shutdown resets Python-level handlers to the default,
        # and a signal landing then killed the finished launcher (exit -15 instead of 0).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return exit_code


def _spawn(name: str, cmd: list[str], env: dict[str, str], nice: int) -> subprocess.Popen:
    # Own process group per child: a terminal Ctrl-C reaches only the launcher, which then
    # stops the children in order, so none is left behind.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    # The api and tokenizers yield the CPU to the worker and scheduler, the step's critical
    # path: on a box with fewer cores than busy processes, a front-end process preempting a
    # worker thread stalls the whole step (docs/benchmarks.md, 32 streams).
    if nice and (name == "api" or name.startswith("tokenizer")):
        base = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, proc.pid, min(base + nice, 19))
    return proc


def _restart(child: Child, env: dict[str, str], nice: int, now: float) -> None:
    """Start a dead tokenizer again; one that keeps dying at once backs off (1, 2, 4... 30 s)
    instead of spinning. The backoff is a deadline the main loop polls, never a sleep, so a
    SIGTERM or an engine death meanwhile is acted on at once."""
    if child.restart_at is None:
        if now - child.started > 30.0:
            child.backoff_s = 0.0  # it had been running fine: restart at once
        child.restart_at = now + min(child.backoff_s, 30.0)
    if now < child.restart_at:
        return
    child.restart_at = None
    child.restarts += 1
    child.backoff_s = RESTART_BACKOFF_S if not child.backoff_s else child.backoff_s * 2
    child.proc = _spawn(child.name, child.cmd, env, nice)
    child.started = time.monotonic()
    _say(f"restarted {child.name} (restart {child.restarts})")


def _engine_lost(children: list[Child]) -> None:
    """The worker or scheduler died: every request in flight is lost. The api fails them with
    an error (503 / SSE error event) and reports unhealthy before anything is stopped."""
    api = next((c for c in children if c.name == "api" and c.proc.poll() is None), None)
    if api is None:
        return
    api.proc.send_signal(signal.SIGUSR1)
    time.sleep(FAIL_GRACE_S)


def _stop_all(children: list[Child], drain_s: float = 0.0, grace_s: float = 10.0) -> None:
    """The api first, with time to drain (it answers 503 meanwhile and ends what is left with an
    error), then everything else; a process that will not stop is killed."""
    api = [c for c in children if c.name == "api"]
    rest = [c for c in reversed(children) if c.name != "api"]
    for group, wait_s in ((api, drain_s + grace_s), (rest, grace_s)):
        for c in group:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
                c.proc.send_signal(signal.SIGCONT)  # a frozen child must run to stop
        deadline = time.monotonic() + wait_s
        for c in group:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    # Children read the format from the environment (every service's --log-format default).
    os.environ["STOKER_LOG_FORMAT"] = args.log_format
    configure_logging("launcher", args.log_format)
    if wants_fleet(args):  # N service sets behind a router (services/fleet)
        from services.fleet.supervisor import serve_fleet

        return serve_fleet(args, argv, parser)
    return serve(args)
