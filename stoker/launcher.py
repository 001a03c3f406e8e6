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

from stoker.common.addresses import Addresses, private_dir
from stoker.common.config import EngineConfig
from stoker.common.config_args import add_flags, flag, from_args, to_json
from stoker.common.logs import add_log_format_arg, configure_logging
from stoker.common.shutdown import StopSignals, stop_processes
from stoker.services.api.config import ApiConfig
from stoker.services.scheduler.config import SchedulerServiceConfig
from stoker.services.tokenizer.config import TokenizerConfig
from stoker.tools.fleet.plan import FleetConfig, wants_fleet

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


@dataclass
class LauncherConfig:
    """`stoker serve`'s own flags; the rest are its children's (their config classes)."""

    tokenizers: int = flag(1, "tokenizer processes")
    frontend_nice: int = flag(
        10,
        "niceness added to the api and tokenizer processes (0: same as the engine)",
        choices=range(20),
        metavar="0..19",
    )
    run_dir: str | None = flag(None, "where ipc sockets live (default: a private temp dir)")


# The api's flags that `stoker serve` sets itself, or takes from the engine's.
_API_OWN = {"model", "num_tokenizers", "max_model_len", "profile_dir"}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="stoker serve")
    add_flags(parser, ApiConfig, skip=_API_OWN)
    add_flags(parser, LauncherConfig)
    add_flags(parser, SchedulerServiceConfig, only={"no_overlap"})
    add_flags(parser, TokenizerConfig, only={"grammar_compile_timeout"})
    add_flags(parser, EngineConfig)
    add_log_format_arg(parser)
    add_flags(parser, FleetConfig)
    return parser


def _commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """Each child's command: its module and its whole config as one JSON object. The API key
    is no part of it: the api reads it from the environment (serve sets it there)."""
    engine = from_args(EngineConfig, args)
    api = from_args(ApiConfig, args, num_tokenizers=args.tokenizers)
    tokenizers = [from_args(TokenizerConfig, args, id=f"tok-{i}") for i in range(args.tokenizers)]
    scheduler = from_args(SchedulerServiceConfig, args, engine=engine)
    cmds = [
        ("worker", _command("stoker.services.worker", engine)),
        ("scheduler", _command("stoker.services.scheduler", scheduler)),
    ]
    cmds += [
        (f"tokenizer-{i}", _command("stoker.services.tokenizer", t))
        for i, t in enumerate(tokenizers)
    ]
    cmds.append(("api", _command("stoker.services.api", api)))
    return cmds


def _command(module: str, config: object) -> list[str]:
    # -P: the working directory does not go on sys.path, so a repository checkout there cannot
    # shadow the installed package (docs/architecture.md, "Package layout").
    return [sys.executable, "-P", "-m", module, "--config-json", to_json(config)]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except Exception:
        return False


def serve(args: argparse.Namespace, commands: list[tuple[str, list[str]]]) -> int:
    if args.run_dir:
        run_dir = str(private_dir(args.run_dir))
    else:
        run_dir = tempfile.mkdtemp(prefix="stoker-")  # 0700, ours
    env = dict(os.environ, STOKER_RUN_DIR=run_dir, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(Addresses.in_run_dir(run_dir).to_env())
    if args.api_key:  # by environment, not argv: the command line is world-readable in /proc
        env["STOKER_API_KEY"] = args.api_key
    children: list[Child] = []
    started = time.monotonic()
    exit_code = 0
    with StopSignals() as signals:
        try:
            for name, cmd in commands:
                children.append(Child(name, cmd, _spawn(name, cmd, env, args.frontend_nice)))
            exit_code = _supervise(args, children, env, started, signals)
        finally:
            _stop_all(children, drain_s=args.shutdown_timeout if exit_code == 0 else 0.0)
            shutil.rmtree(run_dir, ignore_errors=True)
    return exit_code


def _supervise(
    args: argparse.Namespace,
    children: list[Child],
    env: dict[str, str],
    started: float,
    signals: StopSignals,
) -> int:
    """Watch the children until a signal (0) or a fatal death (1); restart tokenizers."""
    health = f"http://{args.host}:{args.port}/health"
    announced = False
    while not signals.requested:
        dead = [c for c in children if c.proc.poll() is not None]
        fatal = [c for c in dead if not c.name.startswith("tokenizer")]
        for c in dead:
            if c.restart_at is None:  # said once, not on every poll of its backoff
                _say(f"{c.name} exited with code {c.proc.returncode}")
        if fatal:
            if any(c.name in ENGINE for c in fatal):
                _engine_lost(children)
            return 1
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
                return 1
        time.sleep(0.2)
    return 0


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
    stop_processes([c.proc for c in children if c.name == "api"], drain_s + grace_s)
    stop_processes([c.proc for c in reversed(children) if c.name != "api"], grace_s)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    # Children read the format from the environment (every service's --log-format default).
    os.environ["STOKER_LOG_FORMAT"] = args.log_format
    configure_logging("launcher", args.log_format)
    if wants_fleet(args):  # N service sets behind a router (tools/fleet)
        from stoker.tools.fleet.supervisor import serve_fleet

        return serve_fleet(args, argv, parser)
    try:  # every child's config is checked here, before anything starts
        commands = _commands(args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    return serve(args, commands)
