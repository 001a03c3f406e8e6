"""A request that arrives before any tokenizer has registered (the api answers seconds before
they do at start-up) waits for one, up to TOKENIZER_WAIT_S, instead of failing at once."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from stoker.common.addresses import Addresses
from stoker.common.config import DEFAULT_MODEL
from stoker.common.messages import TokenizeRequest
from stoker.common.sampling_params import SamplingParams
from stoker.services.api import engine_client
from stoker.services.api.engine_client import EngineClient, _Tokenizer
from stoker.services.api.openai_schema import ApiError
from tests.deploy.procs import CLI, free_port, service_env, stop_all, wait_healthy
from tests.services.test_tokenizer_loss import _post


class _Sent:
    """Stands in for the api's ROUTER socket to the tokenizers (no sockets in this test)."""

    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []

    async def send_multipart(self, frames: list[bytes]) -> None:
        self.frames.append(frames)


def _request(req_id: str) -> TokenizeRequest:
    return TokenizeRequest(req_id, SamplingParams(max_tokens=4), prompt="hi")


def _client() -> EngineClient:
    client = EngineClient(Addresses.in_run_dir("/nonexistent"), num_tokenizers=1)
    client._requests = _Sent()
    client._send_abort = lambda ids: None
    return client


def test_a_request_waits_for_the_first_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "TOKENIZER_WAIT_S", 10.0)
    client = _client()

    async def main() -> None:
        submitted = asyncio.create_task(client.submit([_request("r1")]))
        await asyncio.sleep(0.3)
        assert not submitted.done() and client._requests.frames == []
        client.tokenizers["tok-a"] = _Tokenizer(7, 0, time.monotonic())  # its first heartbeat
        await asyncio.wait_for(submitted, 5)
        assert [frames[0] for frames in client._requests.frames] == [b"tok-a"]
        assert list(client._tracks) == ["r1"]

    asyncio.run(main())


def test_no_tokenizer_within_the_wait_is_a_503_that_leaves_nothing_tracked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_client, "TOKENIZER_WAIT_S", 0.2)
    client = _client()

    async def main() -> None:
        with pytest.raises(ApiError) as err:
            await client.submit([_request("r1"), _request("r2")])
        assert err.value.status == 503 and "no tokenizer" in str(err.value)
        assert client._tracks == {} and client.num_waiting == 0

        # A handler cancelled while it waits (the server stopping) leaves nothing behind.
        monkeypatch.setattr(engine_client, "TOKENIZER_WAIT_S", 30.0)
        submitted = asyncio.create_task(client.submit([_request("r3")]))
        await asyncio.sleep(0.1)
        submitted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitted
        assert client._tracks == {} and client.num_waiting == 0

    asyncio.run(main())


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.skipif(
    not (DEFAULT_MODEL / "config.json").exists(), reason="the bundled model is not built"
)
def test_requests_sent_before_the_tokenizer_starts_are_served(tmp_path):
    """Real processes: the api, scheduler and worker come up with no tokenizer; a completion
    sent then waits, and is served once the tokenizer starts."""
    port = free_port()
    env = service_env(tmp_path)
    model = str(DEFAULT_MODEL)
    py = CLI
    cmds = [
        [*py, "worker", "--model", model],
        [*py, "scheduler", "--model", model],
        [*py, "api", "--model", model, "--port", str(port)],
    ]
    procs = [subprocess.Popen(c, env=env) for c in cmds]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{base}/v1/models", procs=procs)  # the api answers; no tokenizer yet
        assert _status(f"{base}/health") == 503
        body = {"model": "stoker-tiny", "prompt": "Hello", "max_tokens": 6}
        with ThreadPoolExecutor(2) as pool:
            pending = [pool.submit(_post, f"{base}/v1/completions", body) for _ in range(2)]
            time.sleep(1.0)
            assert not any(p.done() for p in pending)
            procs.append(subprocess.Popen([*py, "tokenizer", "--model", model], env=env))
            for p in pending:
                status, out = p.result(timeout=60)
                assert status == 200 and out["usage"]["completion_tokens"] == 6, out
    finally:
        stop_all(procs)
