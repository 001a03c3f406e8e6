"""compose.yaml's `fleet` profile: two stoker replicas behind smg. The structure is checked
statically, the router's command with smg's own argument parser; then (slow) the services'
own commands run as local processes, router first, with the compose hostnames mapped to
loopback ports, and a request goes through. The real containers: docs/fleet.md (podman-compose,
run by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI
from smg.launch_router import parse_router_args

from tests.deploy.procs import stop_all
from tests.fleet.fleet_procs import free_port_run, wait_until

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
FLEET = {k: v for k, v in COMPOSE["services"].items() if "fleet" in v.get("profiles", [])}
REPLICAS = sorted(k for k in FLEET if k != "router")


def _router_args():
    cmd = FLEET["router"]["command"]
    assert cmd[:2] == ["smg", "launch"]
    return parse_router_args(cmd[2:])  # smg's own parser: every flag exists, values are valid


def test_fleet_profile_has_two_replicas_and_the_router():
    assert set(FLEET) == {"replica-a", "replica-b", "router"}
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


def test_router_routes_cache_aware_to_both_replicas_with_health_checks():
    args = _router_args()
    assert args.worker_urls == [f"http://{name}:8000" for name in REPLICAS]
    assert args.policy == "cache_aware"
    assert args.health_check_endpoint == "/health"
    assert args.health_check_interval_secs <= 5
    assert args.host == "0.0.0.0" and args.port == 8000
    router = FLEET["router"]
    assert [str(p) for p in router["ports"]] == [
        "${STOKER_HOST_IP:-127.0.0.1}:${STOKER_FLEET_PORT:-8080}:8000"
    ]
    assert "/readiness" in " ".join(router["healthcheck"]["test"])
    assert "depends_on" not in router  # smg retries a replica that is not up yet


def test_router_uses_the_stoker_image_which_carries_smg():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"smg==' in pyproject  # installed into the image with stoker's dependencies
    images = {svc["image"] for svc in FLEET.values()}
    assert images == {COMPOSE["services"]["api"]["image"]}


@pytest.mark.slow
@pytest.mark.skipif(
    not (REPO / "models" / "stoker-tiny" / "config.json").exists(),
    reason="the bundled model is not built",
)
def test_fleet_services_run_as_local_processes(tmp_path):
    base = free_port_run(len(REPLICAS) + 2)
    ports = {name: base + 1 + i for i, name in enumerate(REPLICAS)}
    router_cmd = list(FLEET["router"]["command"])
    for name, port in ports.items():
        router_cmd[router_cmd.index(f"http://{name}:8000")] = f"http://127.0.0.1:{port}"
    router_cmd[router_cmd.index("--port") + 1] = str(base)
    router_cmd[router_cmd.index("--prometheus-port") + 1] = str(base + len(REPLICAS) + 1)
    router_cmd[router_cmd.index("--host") + 1] = "127.0.0.1"
    procs = [subprocess.Popen([sys.executable, "-m", "smg", *router_cmd[1:]], cwd=REPO)]
    try:
        for name, port in ports.items():  # after the router: start order must not matter
            cmd = [
                a.replace("${STOKER_MODEL:-smollm2}", "stoker-tiny") for a in FLEET[name]["command"]
            ]
            cmd[cmd.index("--port") + 1] = str(port)
            cmd[cmd.index("--host") + 1] = "127.0.0.1"
            cmd += ["--null-model", "--run-dir", str(tmp_path / name)]
            procs.append(
                subprocess.Popen([sys.executable, "-m", "stoker.cli", *cmd[1:]], cwd=REPO)
            )
        url = f"http://127.0.0.1:{base}"

        def both_ready() -> bool:
            try:
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
            except (httpx.HTTPError, ValueError):
                return False
            return sum(w["is_healthy"] and w["status"] == "ready" for w in workers) == 2

        wait_until(both_ready, 240, "both replicas behind the router")
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="stoker-tiny", prompt="ROMEO:", max_tokens=8)
        assert out.usage.completion_tokens == 8
    finally:
        stop_all(procs)
