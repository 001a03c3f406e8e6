"""Processes from different stoker builds refuse each other (common/wire_digest.py): the wire
digest follows the messages' layout, and the api, scheduler and worker check it at their
handshakes and say why in /health and in each request's error."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest

from stoker.common.addresses import Addresses
from stoker.common.config import DEFAULT_MODEL
from stoker.common.messages import SchedulerStats, TokenizerHeartbeat
from stoker.common.wire_digest import PROTOCOL, check_peer, wire_digest
from stoker.services.api.engine_client import EngineClient
from stoker.services.api.openai_schema import ApiError
from tests.deploy.procs import free_port, service_env, stop_all, wait_healthy

REPO = Path(__file__).resolve().parents[2]


def _module(**structs: type) -> types.ModuleType:
    module = types.ModuleType("wire_test")
    for name, cls in structs.items():
        cls.__module__ = module.__name__
        setattr(module, name, cls)
    return module


def _hello(layout: str, doc: str = "") -> type:
    if layout == "plain":

        class Hello(msgspec.Struct, array_like=True, tag="hello"):
            incarnation: str

    elif layout == "renamed":  # the same wire layout under another field name

        class Hello(msgspec.Struct, array_like=True, tag="hello"):  # type: ignore[no-redef]
            session: str

    else:  # a field more

        class Hello(msgspec.Struct, array_like=True, tag="hello"):  # type: ignore[no-redef]
            incarnation: str
            protocol: str = ""

    Hello.__doc__ = doc
    return Hello


def test_the_digest_follows_the_layout_not_the_prose():
    before = wire_digest(_module(Hello=_hello("plain")))
    assert wire_digest(_module(Hello=_hello("plain", doc="reworded"))) == before
    assert wire_digest(_module(Hello=_hello("renamed"))) == before
    assert wire_digest(_module(Hello=_hello("extended"))) != before


def test_every_process_of_one_build_computes_the_same_digest():
    out = subprocess.run(
        [sys.executable, "-c", "from stoker.common.wire_digest import PROTOCOL; print(PROTOCOL)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert out.stdout.strip() == PROTOCOL
    assert check_peer("worker", PROTOCOL) is None
    problem = check_peer("worker", "")
    assert problem is not None and "another stoker build" in problem


def _client(num_tokenizers: int = 1) -> EngineClient:
    client = EngineClient(Addresses.in_run_dir("/nonexistent"), num_tokenizers=num_tokenizers)
    client._send_abort = lambda ids: None  # no sockets in this test
    return client


def _stats(protocol: str) -> SchedulerStats:
    return SchedulerStats(True, 0, 0, 8, 8, 0.0, 0, 0, 0, 64, "m", protocol=protocol)


def test_the_api_refuses_a_scheduler_from_another_build():
    client = _client()
    client._on_heartbeat(TokenizerHeartbeat("tok-a", 10, 0, protocol=PROTOCOL))
    client._on_stats(_stats("0123456789abcdef"))
    ok, reason = client.health()
    assert not ok and "scheduler runs another stoker build" in reason
    error = client.admission_error(1)
    assert error is not None and error.status == 503 and "another stoker build" in error.message
    client._on_stats(_stats(PROTOCOL))  # a scheduler of this build takes over
    assert client.health() == (True, "ok") and client.admission_error(1) is None


def test_a_tokenizer_from_another_build_gets_no_requests(monkeypatch):
    monkeypatch.setattr("stoker.services.api.engine_client.TOKENIZER_WAIT_S", 0.0)
    asyncio.run(_tokenizer_of_another_build())


async def _tokenizer_of_another_build() -> None:
    client = _client()
    client._on_stats(_stats(PROTOCOL))
    client._on_heartbeat(TokenizerHeartbeat("tok-old-1", 10, 0, slot="tok-old"))  # no protocol
    ok, reason = client.health()
    assert not ok and "tokenizer tok-old runs another stoker build" in reason
    assert await client._live_tokenizers() == []
    with pytest.raises(ApiError) as e:
        await client._send_to_tokenizer(b"", None)  # type: ignore[arg-type]
    assert e.value.status == 503 and "tokenizer tok-old runs another stoker build" in str(e.value)
    # One of this build is enough: the other is left out of routing and of the count.
    client._on_heartbeat(TokenizerHeartbeat("tok-new-1", 11, 0, slot="tok-new", protocol=PROTOCOL))
    assert client.health() == (True, "ok")
    assert await client._live_tokenizers() == ["tok-new-1"]
    assert client.state()["tokenizers"]["tok-old"]["refused"] is not None


# A process of "another build": the real service, with its wire digest replaced before anything
# reads it (what a rebuilt image whose messages changed would send).
_OTHER_BUILD = [
    sys.executable,
    "-c",
    "import sys, stoker.common.wire_digest as p; p.PROTOCOL = 'fedcba9876543210'; "
    "from stoker.cli import main; sys.exit(main())",
]
_THIS_BUILD = [sys.executable, "-m", "stoker.cli"]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _complete(base: str) -> tuple[int, dict]:
    body = json.dumps({"model": "stoker-tiny", "prompt": [5, 6, 7], "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_health(base: str, procs: list, words: str, timeout: float = 60.0) -> None:
    """Until /health answers 503 naming `words`."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode}"
        try:
            status, text = _get(f"{base}/health")
        except OSError:
            status, text = 0, ""
        if status == 503 and words in text:
            return
        assert time.monotonic() < deadline, (status, text)
        time.sleep(0.2)


@pytest.mark.skipif(
    not (DEFAULT_MODEL / "config.json").exists(), reason="the bundled model is not built"
)
def test_processes_of_another_build_are_refused_and_replaced(tmp_path):
    """Real processes, one by one. A worker and the only tokenizer of another build: /health and
    a request say the worker is refused; a worker of this build is then served, and the reason
    becomes the tokenizer; with a tokenizer of this build up, requests complete. A worker of
    another build that replaces the good one is refused again."""
    port = free_port()
    env = {**service_env(tmp_path), "STOKER_TOKENIZER_WAIT_S": "1"}
    model = str(DEFAULT_MODEL)
    base = f"http://127.0.0.1:{port}"
    procs = [
        subprocess.Popen([*_THIS_BUILD, "scheduler", "--model", model], env=env),
        subprocess.Popen(
            [*_THIS_BUILD, "api", "--model", model, "--port", str(port), "--num-tokenizers", "1"],
            env=env,
        ),
        subprocess.Popen([*_OTHER_BUILD, "tokenizer", "--model", model, "--id", "old"], env=env),
    ]
    old_worker = subprocess.Popen([*_OTHER_BUILD, "worker", "--model", model], env=env)
    try:
        _wait_health(base, [*procs, old_worker], "worker runs another stoker build")
        status, out = _complete(base)
        assert status == 503 and "worker runs another stoker build" in out["error"]["message"]

        stop_all([old_worker])
        worker = subprocess.Popen([*_THIS_BUILD, "worker", "--model", model], env=env)
        procs.append(worker)
        _wait_health(base, procs, "tokenizer old runs another stoker build")
        status, out = _complete(base)
        assert status == 503 and "tokenizer old runs another stoker build" in str(out)

        procs.append(
            subprocess.Popen([*_THIS_BUILD, "tokenizer", "--model", model, "--id", "new"], env=env)
        )
        wait_healthy(f"{base}/health", procs=procs)
        for _ in range(3):  # every request goes to the tokenizer of this build
            status, out = _complete(base)
            assert status == 200 and out["usage"]["completion_tokens"] == 4

        procs.remove(worker)
        stop_all([worker])
        old_worker = subprocess.Popen([*_OTHER_BUILD, "worker", "--model", model], env=env)
        _wait_health(base, [*procs, old_worker], "worker runs another stoker build")
    finally:
        stop_all([*procs, old_worker])
