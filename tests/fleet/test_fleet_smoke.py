"""One replica behind smg, started the way a user starts a fleet: smg recognises stoker (as a
vLLM-style engine, through /version), routes the OpenAI client's calls to it, and SIGTERM
takes everything down."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.fleet.fleet_procs import MODEL, start_fleet, stop_fleet, workers


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = start_fleet(tmp_path_factory.mktemp("fleet-smoke"), replicas=1)
    yield f
    if f.proc.poll() is None:
        stop_fleet(f)


def test_smg_registers_stoker_as_a_vllm_style_worker(fleet):
    (worker,) = workers(fleet)
    assert worker["url"] == fleet.replica_url(0)
    assert worker["runtime_type"] == "vllm"  # identified by GET /version
    assert worker["model_id"] == MODEL
    version = httpx.get(fleet.replica_url(0) + "/version").json()
    assert version["engine"] == "stoker" and version["version"]


def test_openai_client_through_the_router(fleet):
    client = OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="To be, or not", max_tokens=5)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Speak."}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_router_loads_come_from_the_replicas_metrics(fleet):
    # smg's load monitor for vLLM-style workers reads these gauges off /metrics.
    text = httpx.get(fleet.replica_url(0) + "/metrics").text
    assert "vllm:num_requests_running" in text and "vllm:num_requests_waiting" in text


def test_sigterm_stops_router_and_replicas(fleet):
    assert stop_fleet(fleet) == 0  # and no process of it is left (checked inside)
    assert not (fleet.run_dir / "replica-0").exists()
