"""compose.yaml describes a system that runs. No Docker engine runs here, so this test checks the
file's structure, then starts every service's own `command` and `environment` as local
processes, with compose hostnames mapped to 127.0.0.1, the model variable set to the bundled
stoker-tiny, and the tokenizer scaled to 2 replicas. The real containers:
tests/deploy/test_podman_compose.py (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.procs import free_port, post_json, stop_all, wait_healthy

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
# The stoker set; services under a profile (monitoring) start only when asked for.
SERVICES = {k: v for k, v in COMPOSE["services"].items() if "profiles" not in v}
PROFILED = {k: v for k, v in COMPOSE["services"].items() if "monitoring" in v.get("profiles", [])}
# (the `fleet` profile: tests/deploy/test_compose_fleet.py)


def test_structure():
    assert set(SERVICES) == {"api", "tokenizer", "scheduler", "worker"}
    api = SERVICES["api"]
    assert "healthcheck" in api and "/health" in " ".join(api["healthcheck"]["test"])
    assert [str(p) for p in api["ports"]] == [
        "${STOKER_HOST_IP:-127.0.0.1}:${STOKER_PORT:-8000}:8000"
    ]
    tok = SERVICES["tokenizer"]
    # Scalable: no fixed name and no published ports on the tokenizer.
    assert "container_name" not in tok and "ports" not in tok
    for name, svc in SERVICES.items():
        assert svc["build"]["context"] == "." and "BASE_IMAGE" in svc["build"]["args"]
        assert svc["restart"] == "unless-stopped"
        # Start order does not matter, and podman runs no healthchecks: nothing waits on one.
        assert "depends_on" not in svc, name
        # Only the api's port is published; the tcp ports between services never are.
        assert name == "api" or "ports" not in svc
        env = svc["environment"]
        assert all(env[k].startswith("tcp://") for k in env if k.startswith("STOKER_"))
        assert "${STOKER_MODEL:-smollm2}" in svc["command"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile
    assert re.search(r"^USER stoker$", dockerfile, re.M), "the image runs as a non-root user"
    assert "stoker.services.fetch_model smollm2" in dockerfile
    assert "--no-index --find-links" in dockerfile


def test_monitoring_profile_mounts_files_that_exist_and_scrapes_the_api():
    assert {k: v["profiles"] for k, v in PROFILED.items()} == {
        "prometheus": ["monitoring"],
        "grafana": ["monitoring"],
    }
    for name, svc in PROFILED.items():
        for volume in svc["volumes"]:
            host = volume.split(":")[0]
            assert (REPO / host).exists(), (name, host)
        # Published on the host only, like the api; never the stoker tcp ports.
        assert all(str(p).startswith("${STOKER_HOST_IP:-127.0.0.1}:") for p in svc["ports"])
    prom = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["api:8000"]  # the compose api service
    datasource = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/stoker.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["uid"]}  # every panel reads the provisioned datasource
    provider = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/stoker.yml").read_text()
    )["providers"][0]
    mounted = dict(v.split(":")[:2] for v in PROFILED["grafana"]["volumes"])
    assert mounted["./deploy/grafana/dashboards"] == provider["options"]["path"]


def _local(value: str, api_port: int) -> str:
    for host in SERVICES:
        value = value.replace(f"tcp://{host}:", "tcp://127.0.0.1:")
    value = value.replace("${STOKER_MODEL:-smollm2}", "stoker-tiny")
    return value.replace("8000", str(api_port)) if value == "8000" else value


@pytest.mark.skipif(
    not (REPO / "models" / "stoker-tiny" / "config.json").exists(),
    reason="the bundled model is not built",
)
def test_services_run_as_local_processes():
    api_port = free_port()
    procs = []
    order = ["worker", "scheduler", "tokenizer", "tokenizer", "api"]  # tokenizer scaled to 2
    try:
        for name in order:
            svc = SERVICES[name]
            env = dict(os.environ)
            env.update({k: _local(str(v), api_port) for k, v in svc["environment"].items()})
            cmd = [_local(str(a), api_port) for a in svc["command"]]
            assert cmd[0] == "stoker"
            cmd = [sys.executable, "-m", "stoker.cli", *cmd[1:]]
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
        wait_healthy(f"http://127.0.0.1:{api_port}/health", procs=procs)
        body = json.dumps({"model": "stoker-tiny", "prompt": "ROMEO:", "max_tokens": 8})
        out = post_json(f"http://127.0.0.1:{api_port}/v1/completions", body.encode())
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8
    finally:
        stop_all(procs)
