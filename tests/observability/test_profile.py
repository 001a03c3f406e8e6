"""`stoker serve --profile-dir` over real processes: /start_profile and /stop_profile leave one
loadable Chrome trace per process (worker, scheduler) with the named ranges; num_steps stops on
its own; the routes need the api key, and answer 404 without --profile-dir."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.factory import make_model
from tests.reliability.serve import Served

FLAGS = ["--num-kv-blocks", "128", "--max-model-len", "256"]
KEY = "profile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("profile-model") / "m", "llama")


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    s = Served(model, tmp / "run", tmp / "serve.log", *FLAGS, "--api-key", KEY,
               "--profile-dir", str(tmp / "traces"))  # fmt: skip
    yield s, tmp / "traces"
    s.stop()


def _generate(url: str, n: int = 3) -> None:
    for i in range(n):
        body = {"prompt": f"hello {i}", "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text


def _wait_traces(folder: Path, known: set[Path], timeout: float = 60.0) -> dict[str, Path]:
    """The new trace of each process, once both are written."""
    deadline = time.monotonic() + timeout
    while True:
        new = {p for p in folder.glob("*.json")} - known if folder.exists() else set()
        by_proc = {p.name.split("-")[0]: p for p in new}
        if {"worker", "scheduler"} <= set(by_proc):
            assert len(new) == 2, sorted(p.name for p in new)  # one file per process
            return by_proc
        assert time.monotonic() < deadline, f"traces not written: {sorted(new)}"
        time.sleep(0.1)


def _names(path: Path) -> set[str]:
    trace = json.loads(path.read_text())
    return {e.get("name") for e in trace["traceEvents"]}


def test_start_stop_writes_one_trace_per_process(served) -> None:
    s, folder = served
    r = httpx.post(f"{s.url}/start_profile", json={"record_shapes": True}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "started"
    _generate(s.url)
    r = httpx.post(f"{s.url}/stop_profile", headers=AUTH)
    assert r.status_code == 200, r.text
    traces = _wait_traces(folder, set())
    assert {"forward", "attention", "sample"} <= _names(traces["worker"])
    assert {"schedule", "update"} <= _names(traces["scheduler"])
    _generate(s.url, 1)  # still serving after a trace is written


def test_num_steps_stops_on_its_own(served) -> None:
    s, folder = served
    known = set(folder.glob("*.json")) if folder.exists() else set()
    r = httpx.post(f"{s.url}/start_profile", json={"num_steps": 2}, headers=AUTH)
    assert r.status_code == 200, r.text
    _generate(s.url, 2)  # 2 requests of 6 tokens: more than 2 steps in each process
    traces = _wait_traces(folder, known)
    assert "forward" in _names(traces["worker"])


def test_needs_the_key_and_a_valid_body(served) -> None:
    s, folder = served
    for path in ("/start_profile", "/stop_profile"):
        r = httpx.post(f"{s.url}{path}")
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{s.url}/start_profile", json={"num_stepz": 2}, headers=AUTH)
    assert r.status_code == 400 and "num_stepz" in r.json()["error"]["message"]
    r = httpx.post(f"{s.url}/start_profile", json={"num_steps": 0}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_steps"
    paths = httpx.get(f"{s.url}/openapi.json", headers=AUTH).json()["paths"]
    assert "post" in paths["/start_profile"] and "post" in paths["/stop_profile"]


def test_404_without_profile_dir(model, tmp_path) -> None:
    s = Served(model, tmp_path / "run", tmp_path / "serve.log", *FLAGS)
    try:
        for path in ("/start_profile", "/stop_profile"):
            r = httpx.post(f"{s.url}{path}", json={})
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["type"] == "not_found_error" and "--profile-dir" in error["message"]
    finally:
        s.stop()
