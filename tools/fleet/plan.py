"""The fleet's commands, worked out without starting anything (docs/fleet.md).

`stoker serve --replicas N --router smg` runs N complete `stoker serve` sets, each on its own
loopback port and run directory, `smg launch` on a loopback port of its own, and the fleet's front
(front.py) on --host/--port, which hands smg every request in a form smg forwards verbatim. A
replica gets the caller's flags minus the fleet's own (and minus --host, --port and --run-dir,
which the fleet assigns); the router gets its worker URLs, the policy, health checks fast enough
for a local fleet, and whatever --router-args adds last (so it overrides).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from stoker.common.config_args import flag, flags_of, option_name

POLICIES = (
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "prefix_hash",
    "consistent_hashing",
)
REPLICA_HOST = "127.0.0.1"  # only the router is meant to be reachable
SMG_METRICS_PORT = 29000  # smg's own default

_FLEET = "fleet: replicas behind a router (docs/fleet.md)"

# A replica is `python <SERVE> <its flags>`; -P keeps the working directory off sys.path (a
# checkout there must not shadow the installed package: docs/architecture.md).
SERVE = ["-P", "-m", "stoker.cli", "serve"]
FRONT = ["-P", "-m", "stoker.tools.fleet.front"]


@dataclass
class FleetConfig:
    """`stoker serve`'s fleet flags (all in --help's fleet section)."""

    replicas: int = flag(
        1,
        "stoker replicas to run, each a full service set (more than 1 implies --router smg)",
        group=_FLEET,
    )
    router: str | None = flag(
        None,
        "put the Shepherd Model Gateway (`smg launch`) in front on --host/--port",
        choices=["smg"],
        group=_FLEET,
    )
    router_policy: str = flag(
        "cache_aware", "smg's routing policy (default: cache_aware)", choices=POLICIES, group=_FLEET
    )
    replica_port: int | None = flag(
        None,
        "first replica's port on 127.0.0.1; the others follow (default: --port + 1)",
        group=_FLEET,
    )
    router_port: int | None = flag(
        None,
        "smg's own port on 127.0.0.1, behind the fleet's front (default: after the last replica)",
        group=_FLEET,
    )
    router_metrics_port: int = flag(
        SMG_METRICS_PORT, "port of smg's own Prometheus listener (default: 29000)", group=_FLEET
    )
    router_args: str = flag(
        "",
        "more `smg launch` flags, one shell-quoted string, appended last",
        metavar="'FLAGS'",
        group=_FLEET,
    )


# Flags the fleet consumes, each taking a value; everything else goes to every replica.
_FLEET_FLAGS = {option_name(n) for n, _, _ in flags_of(FleetConfig)} | {
    "--host",
    "--port",
    "--run-dir",
}

# Flags naming a port or a file that N replicas cannot share.
_ONE_PER_HOST = ("master_port", "kv_events_config", "log_requests")


def wants_fleet(args: argparse.Namespace) -> bool:
    return args.replicas > 1 or args.router is not None


@dataclass(frozen=True)
class Replica:
    index: int
    port: int
    run_dir: Path
    cmd: list[str]

    @property
    def url(self) -> str:
        return f"http://{REPLICA_HOST}:{self.port}"


@dataclass(frozen=True)
class FleetPlan:
    replicas: list[Replica]
    router_cmd: list[str]  # smg, on REPLICA_HOST:router_port
    front_cmd: list[str]  # the front, on --host/--port
    router_url: str  # where clients connect: the front (loopback form of --host)


def replica_argv(argv: list[str]) -> list[str]:
    """argv without the fleet's flags, in both `--flag value` and `--flag=value` forms."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _FLEET_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def router_command(
    args: argparse.Namespace,
    worker_urls: list[str],
    python: str = sys.executable,
    host: str | None = None,
    port: int | None = None,
) -> list[str]:
    """`smg launch` for these workers, on host:port (default: --host, --port)."""
    host, port = host or args.host, port or args.port
    cmd = [python, "-m", "smg", "launch", "--host", host, "--port", str(port)]
    cmd += ["--worker-urls", *worker_urls, "--policy", args.router_policy]
    cmd += [
        "--health-check-endpoint", "/health",
        # smg's defaults (every 60 s, 3 failures) suit a cluster; a local fleet should route
        # around a dead replica, and take a restarted one back, within seconds.
        "--health-check-interval-secs", "2",
        "--health-failure-threshold", "2",
        "--health-success-threshold", "1",
        # It routes on request text (cache_aware's tree is over characters on the HTTP path),
        # so it needs no tokenizer; autoload would try the model name on the hub.
        "--disable-tokenizer-autoload",
        "--prometheus-host", args.host,  # smg's default is every interface
        "--prometheus-port", str(args.router_metrics_port),
        "--shutdown-grace-period-secs", str(max(1, int(args.shutdown_timeout))),
        "--log-level", "warn",
        # A body smg can route without reading (the front's routing hint) is streamed to the
        # replica verbatim instead of parsed into smg's types, which lose fields (front.py).
        "--max-buffered-request-bytes", "0",
    ]  # fmt: skip
    if args.api_key:  # smg checks it on the data plane and passes it on to the workers
        cmd += ["--api-key", args.api_key]
    return cmd + shlex.split(args.router_args)


def front_command(
    args: argparse.Namespace, router_url: str, python: str = sys.executable
) -> list[str]:
    """The front (front.py) on --host/--port, ahead of smg at router_url."""
    cmd = [python, *FRONT, "--host", args.host, "--port", str(args.port), "--router", router_url]
    return cmd + ["--shutdown-timeout", str(args.shutdown_timeout)]


def plan_fleet(
    args: argparse.Namespace, argv: list[str], run_root: Path, python: str = sys.executable
) -> FleetPlan:
    clash = [f"--{f.replace('_', '-')}" for f in _ONE_PER_HOST if getattr(args, f, None)]
    if args.replicas > 1 and clash:
        raise ValueError(
            f"{', '.join(clash)}: every replica would bind or write the same place; "
            "run the replicas by hand, each with its own, behind `smg launch` (docs/fleet.md)"
        )
    base = args.replica_port if args.replica_port is not None else args.port + 1
    shared = replica_argv(argv)
    replicas = []
    for i in range(args.replicas):
        port, run_dir = base + i, run_root / f"replica-{i}"
        cmd = [python, *SERVE, *shared]
        cmd += ["--host", REPLICA_HOST, "--port", str(port), "--run-dir", str(run_dir)]
        replicas.append(Replica(i, port, run_dir, cmd))
    urls = [r.url for r in replicas]
    if args.port in {r.port for r in replicas}:
        raise ValueError(f"--port {args.port} collides with a replica port ({base}..)")
    smg_port = args.router_port if args.router_port is not None else base + args.replicas
    ports = [args.port, *(r.port for r in replicas), smg_port, args.router_metrics_port]
    if len(set(ports)) < len(ports):
        raise ValueError(
            f"ports collide: --port {args.port}, replicas {base}.., --router-port {smg_port}, "
            f"--router-metrics-port {args.router_metrics_port}"
        )
    router = router_command(args, urls, python, REPLICA_HOST, smg_port)
    front = front_command(args, f"http://{REPLICA_HOST}:{smg_port}", python)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return FleetPlan(replicas, router, front, f"http://{host}:{args.port}")


def check_replica_argv(parse: argparse.ArgumentParser, cmd_tail: list[str]) -> None:
    """A replica must not start a fleet of its own (an abbreviated fleet flag, say `--rep 2`,
    is not stripped but would still parse as one)."""
    replica = parse.parse_args(cmd_tail)
    if wants_fleet(replica):
        raise ValueError("spell the fleet flags (--replicas, --router, ...) out in full")
