"""compose.yaml's `fleet` profile: two stoker replicas behind smg and the fleet's front (as
`stoker serve --replicas N` runs them, tools/fleet/). The structure is checked statically, smg's
command with smg's own argument parser and the front's with its own; then (slow) the services'
own commands run as local processes, smg and the front first, with the compose hostnames mapped
to loopback ports, and requests go through the published port, a token-id prompt among them.
The real containers: docs/fleet.md (podman-compose, run by hand)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml
from openai import OpenAI
from smg.launch_router import parse_router_args

from stoker.tools.fleet import front, plan
from tests.deploy.procs import stop_all
from tests.fleet.fleet_procs import free_port_run, wait_until

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
FLEET = {k: v for k, v in COMPOSE["services"].items() if "fleet" in v.get("profiles", [])}
REPLICAS = sorted(k for k in FLEET if k.startswith("replica-"))
PUBLISHED = "${STOKER_HOST_IP:-127.0.0.1}:${STOKER_FLEET_PORT:-8080}:8000"


def _smg_args():
    cmd = FLEET["smg"]["command"]
    assert cmd[:2] == ["smg", "launch"]
    return parse_router_args(cmd[2:])  # smg's own parser: every flag exists, values are valid


def _front_args(monkeypatch) -> dict:
    """The router service's command through front.main's own parser; nothing is started."""
    cmd = FLEET["router"]["command"]
    assert cmd[0] == "python" and cmd[1:4] == plan.FRONT  # -P -m stoker.tools.fleet.front
    seen: dict = {}
    monkeypatch.setattr(front, "build_app", lambda router: seen.update(router=router))
    monkeypatch.setattr(front.web, "run_app", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(front, "uvloop", SimpleNamespace(new_event_loop=lambda: None))
    front.main(cmd[4:])
    return seen


def test_fleet_profile_has_two_replicas_smg_and_the_router():
    assert set(FLEET) == {"replica-a", "replica-b", "smg", "router"}
    assert all(svc["profiles"] == ["fleet"] for svc in FLEET.values())
    assert len(REPLICAS) == 2


def test_replicas_are_whole_stoker_sets_that_publish_nothing():
    for name in REPLICAS:
        svc = FLEET[name]
        cmd = svc["command"]
        assert cmd[:2] == ["stoker", "serve"] and "${STOKER_MODEL:-smollm2}" in cmd
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[cmd.index("--port") + 1] == "8000"
        # One container holds the set on ipc://: none of the split services' tcp addresses.
        assert svc["environment"] == {}
        assert "ports" not in svc, "only the router is published"
        assert "/health" in " ".join(svc["healthcheck"]["test"])
        assert svc["restart"] == "unless-stopped" and svc["build"]["context"] == "."
        assert "depends_on" not in svc


def test_smg_routes_cache_aware_to_both_replicas_with_health_checks():
    args = _smg_args()
    assert args.worker_urls == [f"http://{name}:8000" for name in REPLICAS]
    assert args.policy == "cache_aware"
    assert args.health_check_endpoint == "/health"
    assert args.health_check_interval_secs <= 5
    assert args.host == "0.0.0.0" and args.port == 8000  # for the front, on the compose network
    smg = FLEET["smg"]
    assert "ports" not in smg, "clients reach smg only through the front"
    assert "/readiness" in " ".join(smg["healthcheck"]["test"])
    assert "depends_on" not in smg  # smg retries a replica that is not up yet


def test_smg_runs_the_local_fleets_flags():
    """The flags that decide what smg does with a request are the ones `stoker serve --replicas`
    gives it (plan.router_command): above all, no body held for a retry, so that a body with
    the front's routing hint is streamed to the replica verbatim."""
    local = argparse.Namespace(
        host="127.0.0.1", port=8000, router_policy="cache_aware", router_metrics_port=29000,
        shutdown_timeout=30.0, api_key=None, router_args="",
    )  # fmt: skip
    ours = _smg_args()
    theirs = parse_router_args(plan.router_command(local, ["http://x:1"])[4:])
    assert ours.max_buffered_request_bytes == 0
    for field in (
        "policy", "health_check_endpoint", "health_check_interval_secs",
        "health_failure_threshold", "health_success_threshold", "disable_tokenizer_autoload",
        "max_buffered_request_bytes", "prometheus_port", "log_level",
    ):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field


def test_router_is_the_front_ahead_of_smg_on_the_published_port(monkeypatch):
    args = _front_args(monkeypatch)
    assert args["host"] == "0.0.0.0" and args["port"] == 8000
    assert args["router"] == f"http://smg:{_smg_args().port}"
    router = FLEET["router"]
    assert [str(p) for p in router["ports"]] == [PUBLISHED]
    # The whole path: the front answers /readiness from smg, 200 once a replica is healthy.
    assert "http://127.0.0.1:8000/readiness" in " ".join(router["healthcheck"]["test"])
    # `up -d router replica-a replica-b` brings smg along; start order only, no healthcheck
    # condition (podman runs no healthchecks without systemd).
    assert router["depends_on"] == ["smg"]
    assert router["environment"] == {}


def test_router_and_smg_use_the_stoker_image_which_carries_both():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"smg==' in pyproject  # installed into the image with stoker's dependencies
    images = {svc["image"] for svc in FLEET.values()}
    assert images == {COMPOSE["services"]["api"]["image"]}
    dockerignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "!tools" in dockerignore  # the front, as stoker.tools.fleet.front in the image


@pytest.mark.slow
@pytest.mark.skipif(
    not (REPO / "models" / "stoker-tiny" / "config.json").exists(),
    reason="the bundled model is not built",
)
def test_fleet_services_run_as_local_processes(tmp_path):
    # The front on base (the published port), the replicas after it, then smg and its metrics.
    base = free_port_run(len(REPLICAS) + 3)
    ports = {name: base + 1 + i for i, name in enumerate(REPLICAS)}
    smg_port = base + len(REPLICAS) + 1
    smg_cmd = list(FLEET["smg"]["command"])
    for name, port in ports.items():
        smg_cmd[smg_cmd.index(f"http://{name}:8000")] = f"http://127.0.0.1:{port}"
    smg_cmd[smg_cmd.index("--port") + 1] = str(smg_port)
    smg_cmd[smg_cmd.index("--prometheus-port") + 1] = str(smg_port + 1)
    smg_cmd[smg_cmd.index("--host") + 1] = "127.0.0.1"
    front_cmd = list(FLEET["router"]["command"])
    front_cmd[front_cmd.index("--router") + 1] = f"http://127.0.0.1:{smg_port}"
    front_cmd[front_cmd.index("--port") + 1] = str(base)
    front_cmd[front_cmd.index("--host") + 1] = "127.0.0.1"
    procs = [
        subprocess.Popen([sys.executable, "-m", "smg", *smg_cmd[1:]], cwd=REPO),
        subprocess.Popen([sys.executable, *front_cmd[1:]], cwd=REPO),
    ]
    try:
        for name, port in ports.items():  # after the router: start order must not matter
            cmd = [
                a.replace("${STOKER_MODEL:-smollm2}", "stoker-tiny") for a in FLEET[name]["command"]
            ]
            cmd[cmd.index("--port") + 1] = str(port)
            cmd[cmd.index("--host") + 1] = "127.0.0.1"
            cmd += ["--null-model", "--run-dir", str(tmp_path / name)]
            procs.append(subprocess.Popen([sys.executable, "-m", "stoker.cli", *cmd[1:]], cwd=REPO))
        url = f"http://127.0.0.1:{base}"  # the published port: the front

        def both_ready() -> bool:
            try:
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return sum(w["is_healthy"] and w["status"] == "ready" for w in workers) == 2

        wait_until(both_ready, 240, "both replicas behind the router")
        assert httpx.get(url + "/readiness", timeout=5).status_code == 200  # the healthcheck
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="stoker-tiny", prompt="ROMEO:", max_tokens=8)
        assert out.usage.completion_tokens == 8
        # A prompt of token ids: smg alone refuses it (its own 400, tests/fleet/
        # test_smg_contract.py); through the published port it reaches a replica as sent.
        ids = {"model": "stoker-tiny", "prompt": [1, 2, 3, 4], "max_tokens": 4}
        alone = httpx.post(f"http://127.0.0.1:{smg_port}/v1/completions", json=ids, timeout=30)
        assert alone.status_code == 400, alone.text
        out = client.completions.create(**ids)
        assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 4
    finally:
        stop_all(procs)
