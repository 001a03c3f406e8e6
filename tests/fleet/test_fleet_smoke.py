"""One replica behind smg, started the way a user starts a fleet: smg recognises stoker (as a
vLLM-style engine, through /version), routes the OpenAI client's calls to it, answers every
request as the replica alone does (token-id prompts included), and SIGTERM takes everything
down."""

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


def _answer(response: httpx.Response) -> tuple[int, dict]:
    out = {k: v for k, v in response.json().items() if k not in ("id", "created")}
    if "usage" in out:  # the second of two asks finds the first's prompt cached
        out["usage"].pop("prompt_tokens_details", None)
    return response.status_code, out


def _same_as_one_replica(fleet, path: str, body: dict) -> httpx.Response:
    """The router's answer and the replica's own, asked directly: alike but for id and time."""
    routed = httpx.post(fleet.url + path, json=body, timeout=60)
    direct = httpx.post(fleet.replica_url(0) + path, json=body, timeout=60)
    assert _answer(routed) == _answer(direct)
    return routed


def test_token_id_prompt_through_the_router(fleet):
    # smg alone refuses a prompt of token ids; the fleet's front makes smg forward it as sent.
    body = {"model": MODEL, "prompt": [11, 12, 13, 14], "max_tokens": 3, "temperature": 0}
    out = _same_as_one_replica(fleet, "/v1/completions", body)
    assert out.status_code == 200, out.text
    usage = out.json()["usage"]
    assert usage["prompt_tokens"] == 4 and usage["completion_tokens"] == 3
    # A batch the replica refuses is refused by the replica, in its words, not by smg.
    batch = {**body, "prompt": [[11, 12, 13], [14, 15]]}
    assert _same_as_one_replica(fleet, "/v1/completions", batch).status_code == 400


def test_metadata_json_object_and_tools_through_the_router(fleet):
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 8,
        "temperature": 0, "metadata": {"team": "fleet"}, "response_format": {"type": "json_object"},
        "tools": [tool], "tool_choice": "none",
    }  # fmt: skip
    out = _same_as_one_replica(fleet, "/v1/chat/completions", body)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["message"]["content"].startswith("{")  # json_object
    # With tool_choice auto one grammar allows a call or the JSON answer (docs/tool-calling.md).
    auto = _same_as_one_replica(fleet, "/v1/chat/completions", {**body, "tool_choice": "auto"})
    assert auto.status_code == 200, auto.text


def test_sigterm_stops_router_and_replicas(fleet):
    assert stop_fleet(fleet) == 0  # and no process of it is left (checked inside)
    assert not (fleet.run_dir / "replica-0").exists()
