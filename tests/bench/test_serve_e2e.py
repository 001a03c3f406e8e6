"""`stoker bench serve` end to end against a real (tiny, fake) OpenAI-compatible HTTP server.

The server is a starlette app under uvicorn in a background thread. It streams `max_tokens`
tokens in OpenAI's SSE format with small sleeps, some chunks carrying two tokens, then a usage
chunk and `data: [DONE]`; like stoker it rejects unknown body fields. Prompts "FAIL" and
"STREAM_ERROR" fail before and during the stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stoker.tools.bench import offline, serve
from stoker.tools.bench.plot import have_matplotlib

MODEL = "fake-model"
KNOWN = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "stream", "stream_options", "ignore_eos",
}  # fmt: skip
TOKEN_SLEEP_S = 0.005


class State:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def make_app(state: State) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "root": MODEL}]})

    async def generate(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        if unknown := set(body) - KNOWN:
            return JSONResponse({"error": {"message": f"unknown {sorted(unknown)}"}}, 400)
        state.bodies.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "FAIL":
            return JSONResponse({"error": {"message": "bad prompt"}}, 400)
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        if chat:
            n_prompt += sum(len(m["content"].split()) for m in body["messages"][:-1])
        n_out = body["max_completion_tokens"] if chat else body["max_tokens"]

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            return {"id": "x", "model": MODEL, "choices": [choice]}

        async def events() -> AsyncIterator[bytes]:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if chat:
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    yield sse({"id": "x", "model": MODEL, "choices": [role]})
                i = 0
                while i < n_out:
                    await asyncio.sleep(TOKEN_SLEEP_S)
                    k = 2 if i % 3 == 2 and i + 1 < n_out else 1  # some chunks carry 2 tokens
                    yield sse(chunk("tok " * k))
                    i += k
                    if prompt == "STREAM_ERROR":
                        yield sse({"error": {"message": "engine died", "type": "internal"}})
                        break
                yield sse(chunk("", finish="length"))
                if body["stream_options"]["include_usage"]:
                    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out}
                    yield sse({"id": "x", "model": MODEL, "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
        ]
    )


@pytest.fixture
def server() -> Iterator[tuple[str, State]]:
    state = State()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(state), log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(10)
    sock.close()


def run(args: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "result.json"
    rc = serve.main([*args, "--result-json", str(out), "--disable-tqdm"])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def test_random_completions(server: tuple[str, State], tmp_path: Path) -> None:
    url, state = server
    plot = tmp_path / "plots" / "bench.png"
    args = [
        "--base-url", url, "--num-prompts", "8", "--max-concurrency", "4",
        "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos",
    ]  # fmt: skip
    if have_matplotlib():  # an optional dependency
        args += ["--plot", str(plot)]
    rc, res = run(args, tmp_path)
    assert rc == 0
    assert (res["completed"], res["failed"], res["num_prompts"]) == (8, 0, 8)
    assert res["model_id"] == MODEL and res["max_concurrency"] == 4
    assert res["request_rate"] == "inf"
    assert res["total_input_tokens"] == 8 * 16 and res["total_output_tokens"] == 8 * 8
    assert res["output_lens"] == [8] * 8 and res["errors"] == [""] * 8
    # 8 tokens come as 6 chunks (two carry 2 tokens): 5 ITL gaps per request
    assert [len(gaps) for gaps in res["itls"]] == [5] * 8
    assert all(t > 0 for t in res["ttfts"]) and res["mean_ttft_ms"] > 0
    assert res["mean_tpot_ms"] > 0 and res["p99_itl_ms"] >= res["median_itl_ms"] > 0
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    assert res["total_token_throughput"] == pytest.approx((8 * 16 + 8 * 8) / res["duration"])
    assert 1 <= res["max_concurrent_requests"] <= 4
    if have_matplotlib():
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # what the server saw: token-id prompts of exact length, ignore_eos, bounded concurrency
    assert len(state.bodies) == 8 and state.max_in_flight <= 4
    for body in state.bodies:
        assert body["model"] == MODEL and body["ignore_eos"] is True
        assert body["temperature"] == 0.0 and body["stream"] is True
        assert len(body["prompt"]) == 16 and all(isinstance(t, int) for t in body["prompt"])


def test_shared_prefix_chat(server: tuple[str, State], tmp_path: Path) -> None:
    url, state = server
    args = [
        "--base-url", url + "/v1", "--endpoint", "/v1/chat/completions", "--model", MODEL,
        "--dataset", "shared-prefix", "--shared-prefix-len", "12", "--random-input-len", "6",
        "--random-output-len", "3", "--num-prompts", "4", "--request-rate", "200",
        "--metric-percentiles", "50,90",
    ]  # fmt: skip
    rc, res = run(args, tmp_path)
    assert rc == 0 and res["completed"] == 4 and res["backend"] == "openai-chat"
    assert res["total_output_tokens"] == 12 and res["total_input_tokens"] == 4 * 18
    assert "p90_ttft_ms" in res and "p99_ttft_ms" not in res
    systems = {b["messages"][0]["content"] for b in state.bodies}
    users = {b["messages"][1]["content"] for b in state.bodies}
    assert len(systems) == 1 and len(next(iter(systems)).split()) == 12
    assert len(users) == 4 and "ignore_eos" not in state.bodies[0]


def test_jsonl_with_failures(server: tuple[str, State], tmp_path: Path) -> None:
    url, _ = server
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "hello there", "max_tokens": 4},
        {"prompt": "FAIL"},
        {"prompt": [5, 6, 7]},
        {"prompt": "STREAM_ERROR", "max_tokens": 5},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--base-url", url, "--dataset", "jsonl", "--dataset-path", str(data)]
    rc, res = run([*args, "--random-output-len", "2", "--num-prompts", "10"], tmp_path)
    assert rc == 0 and (res["completed"], res["failed"]) == (2, 2)
    assert res["successes"] == [True, False, True, False]
    assert res["errors"][1].startswith("HTTP 400") and "bad prompt" in res["errors"][1]
    assert res["errors"][3].startswith("stream error") and "engine died" in res["errors"][3]
    assert res["output_lens"][0] == 4 and res["output_lens"][2] == 2
    assert res["total_input_tokens"] == 2 + 3 and res["total_output_tokens"] == 6


def test_all_failed_or_unreachable(server: tuple[str, State], tmp_path: Path) -> None:
    url, _ = server
    data = tmp_path / "fail.jsonl"
    data.write_text('{"prompt": "FAIL"}\n')
    rc, res = run(["--base-url", url, "--dataset", "jsonl", "--dataset-path", str(data)], tmp_path)
    assert rc == 1 and res["failed"] == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert serve.main(["--port", str(closed), "--num-prompts", "1", "--disable-tqdm"]) == 1


def test_offline_forwards_args(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(offline.subprocess, "call", lambda cmd: calls.append(cmd) or 3)
    assert offline.main(["--n", "4", "--skip-hf"]) == 3
    assert calls[0][1].endswith("benchmarks/offline_throughput.py")
    assert calls[0][2:] == ["--n", "4", "--skip-hf"]
    assert Path(calls[0][1]).is_file()
