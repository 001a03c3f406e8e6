"""The fleet's commands and workload, without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.launcher import build_parser
from stoker.tools.fleet.plan import check_replica_argv, plan_fleet, replica_argv
from stoker.tools.fleet.workload import PrefixCounters, prefix_counters, shared_prefix_prompts


def _plan(argv: list[str]):
    parser = build_parser()
    return parser, plan_fleet(parser.parse_args(argv), argv, Path("/run/fleet"), python="py")


def test_replica_argv_drops_the_fleet_flags_in_both_forms():
    argv = ["--model", "m", "--replicas", "3", "--router=smg", "--port", "9000"]
    argv += ["--router-args", "--cache-threshold 0.5", "--host=0.0.0.0", "--run-dir", "d"]
    argv += ["--max-num-seqs", "8", "--null-model"]
    assert replica_argv(argv) == ["--model", "m", "--max-num-seqs", "8", "--null-model"]


def test_replicas_get_their_own_ports_and_run_dirs_and_the_router_their_urls():
    _, plan = _plan(["--model", "m", "--replicas", "2", "--port", "9000", "--tokenizers", "2"])
    assert [r.port for r in plan.replicas] == [9001, 9002]
    assert [r.run_dir for r in plan.replicas] == [
        Path("/run/fleet/replica-0"),
        Path("/run/fleet/replica-1"),
    ]
    assert plan.replicas[1].cmd == [
        "py", "-P", "-m", "stoker.cli", "serve", "--model", "m", "--tokenizers", "2",
        "--host", "127.0.0.1", "--port", "9002", "--run-dir", "/run/fleet/replica-1",
    ]  # fmt: skip
    cmd = plan.router_cmd
    assert cmd[:4] == ["py", "-m", "smg", "launch"]
    urls = cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3]
    assert urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    # smg on loopback after the last replica; the front on --port, ahead of it.
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "9003"
    assert cmd[cmd.index("--max-buffered-request-bytes") + 1] == "0"  # verbatim forwarding
    assert cmd[cmd.index("--health-check-endpoint") + 1] == "/health"
    assert plan.front_cmd == [
        "py", "-P", "-m", "stoker.tools.fleet.front", "--host", "127.0.0.1", "--port", "9000",
        "--router", "http://127.0.0.1:9003", "--shutdown-timeout", "30.0",
    ]  # fmt: skip
    assert plan.router_url == "http://127.0.0.1:9000"


def test_router_args_come_last_and_the_policy_is_a_flag():
    argv = ["--replicas", "2", "--router-policy", "round_robin", "--replica-port", "7000"]
    _, plan = _plan(argv + ["--router-args", "--health-check-interval-secs 5"])
    assert plan.router_cmd[-2:] == ["--health-check-interval-secs", "5"]
    assert plan.router_cmd[plan.router_cmd.index("--policy") + 1] == "round_robin"
    assert [r.port for r in plan.replicas] == [7000, 7001]


def test_api_key_reaches_the_router():
    _, plan = _plan(["--replicas", "2", "--api-key", "sekret"])
    assert plan.router_cmd[plan.router_cmd.index("--api-key") + 1] == "sekret"


def test_a_replica_port_on_the_router_port_is_refused():
    with pytest.raises(ValueError, match="collides"):
        _plan(["--replicas", "2", "--port", "7001", "--replica-port", "7000"])


def test_smgs_port_is_a_flag_and_must_not_collide():
    _, plan = _plan(["--replicas", "2", "--port", "9000", "--router-port", "9500"])
    assert plan.router_cmd[plan.router_cmd.index("--port") + 1] == "9500"
    assert plan.front_cmd[plan.front_cmd.index("--router") + 1] == "http://127.0.0.1:9500"
    with pytest.raises(ValueError, match="collide"):
        _plan(["--replicas", "2", "--port", "9000", "--router-metrics-port", "9003"])
    with pytest.raises(ValueError, match="collide"):
        _plan(["--replicas", "2", "--port", "9000", "--router-port", "9002"])


def test_a_replica_that_would_start_a_fleet_is_refused():
    # A safety net: every abbreviation of --replicas / --router is ambiguous today, so none
    # slips past replica_argv, but a replica parsing as a fleet would recurse.
    parser = build_parser()
    check_replica_argv(parser, ["--model", "m", "--port", "9001"])
    with pytest.raises(ValueError, match="in full"):
        check_replica_argv(parser, ["--model", "m", "--replicas", "2"])


def test_shared_prefix_prompts():
    prompts = shared_prefix_prompts(groups=3, per_group=4, prefix_words=20, seed=1)
    assert len(prompts) == 12 and len(set(prompts)) == 12
    heads = {p.split("\n")[0] for p in prompts}
    assert len(heads) == 3  # three prefixes, four questions each
    assert prompts == shared_prefix_prompts(groups=3, per_group=4, prefix_words=20, seed=1)
    other = {p.split("\n")[0] for p in shared_prefix_prompts(3, 4, prefix_words=20, seed=2)}
    assert not heads & other


def test_prefix_counters_from_metrics_text():
    text = (
        "# TYPE stoker:prefix_cache_queries counter\nstoker:prefix_cache_queries_total 200.0\n"
        "# TYPE stoker:prefix_cache_hits counter\nstoker:prefix_cache_hits_total 150.0\n"
    )
    c = prefix_counters(text)
    assert c == PrefixCounters(200.0, 150.0) and c.hit_rate == 0.75
    assert (c - PrefixCounters(100.0, 100.0)).hit_rate == 0.5
    assert PrefixCounters(0.0, 0.0).hit_rate == 0.0


def test_router_command_parses_with_smgs_own_parser():
    from smg.launch_router import parse_router_args

    _, plan = _plan(["--replicas", "3", "--port", "9000", "--router-args", "--cache-threshold 0.5"])
    args = parse_router_args(plan.router_cmd[4:])
    assert args.worker_urls == [r.url for r in plan.replicas]
    assert args.policy == "cache_aware" and args.cache_threshold == 0.5
    assert args.health_check_endpoint == "/health" and args.health_check_interval_secs == 2


@pytest.mark.parametrize(
    "flag",
    [["--master-port", "29501"], ["--log-requests", "/tmp/log"], ["--kv-events-config", "{}"]],
)
def test_flags_replicas_cannot_share_are_refused(flag):
    with pytest.raises(ValueError, match="same place"):
        _plan(["--replicas", "2", *flag])
    _plan(["--replicas", "1", "--router", "smg", *flag])  # one replica: fine
