"""A stand-in replica that records what a router sends it (tests/fleet/test_smg_contract.py).

It answers the probes smg makes of a worker the way stoker does (docs/fleet.md, "What stoker
exposes for SMG") and any OpenAI generation request with a small valid response, so smg
registers it as a healthy vLLM-style worker; every request it gets is kept, body bytes and all,
for a test to compare with what the client sent.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

MODEL = "capture-model"
_JSON = "application/json"
_METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0\n"
_CARD = {"id": MODEL, "object": "model", "owned_by": "stoker", "root": MODEL, "max_model_len": 4096}
# What smg 1.13 asks of a worker, answered as stoker does (docs/fleet.md); anything else: 404.
_PROBES = {
    "/health": b"",
    "/version": b'{"version": "0.1.0", "engine": "stoker"}',
    "/v1/models": msgspec.json.encode({"object": "list", "data": [_CARD]}),
    "/metrics": _METRICS.encode(),
}


@dataclass(frozen=True)
class Captured:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return msgspec.json.decode(self.body)


@dataclass
class CaptureBackend:
    port: int
    seen: list[Captured] = field(default_factory=list)
    answers: list[bytes] = field(default_factory=list)  # each generation's response body
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generations(self) -> list[Captured]:
        return [c for c in self.seen if c.method == "POST"]

    def probes(self) -> set[tuple[str, str]]:
        return {(c.method, c.path) for c in self.seen if c.method != "POST"}

    async def _any(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        self.seen.append(Captured(request.method, path, dict(request.headers), body))
        if request.method == "POST" and path.endswith("/completions"):
            answer = _answer(path, msgspec.json.decode(body) if body else {})
            self.answers.append(bytes(answer.body))
            return answer
        answer = _PROBES.get(path)
        if answer is None:
            return Response(status_code=404)
        media = "text/plain" if path == "/metrics" else _JSON
        return Response(answer, media_type=media)

    def start(self) -> CaptureBackend:
        methods = ["GET", "POST", "PUT", "DELETE", "HEAD"]
        app = Starlette(routes=[Route("/{path:path}", self._any, methods=methods)])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the capture backend did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)


# Fields beyond OpenAI's that stoker (or vLLM) answers with, to see a router keep them.
_EXTRA = {
    "prompt_logprobs": [None, {"7": {"logprob": -1.5, "rank": 1, "decoded_token": "a"}}],
    "prompt_token_ids": [7, 8],
    "system_fingerprint": None,
}
_LOGPROBS = {
    "tokens": ["token_id:5"],
    "token_logprobs": [-0.1],
    "top_logprobs": [{"token_id:5": -0.1}],
    "text_offset": [0],
}


def _answer(path: str, req: dict) -> Response:
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    chat = path.endswith("/chat/completions")
    message = {"role": "assistant", "content": "ok"}
    part: dict = {"index": 0, "stop_reason": None, "token_ids": [5]}
    part |= {"message": message} if chat else {"text": "ok", "logprobs": _LOGPROBS}
    head = {"id": "cmpl-capture", "created": 0, "model": req.get("model", MODEL), **_EXTRA}
    if not req.get("stream"):
        kind = "chat.completion" if chat else "text_completion"
        out = {**head, "object": kind, "choices": [{**part, "finish_reason": "stop"}]}
        return Response(msgspec.json.encode({**out, "usage": usage}), media_type=_JSON)
    kind = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        part = {"index": 0, "delta": message}
    chunk = {**head, "object": kind, "choices": [{**part, "finish_reason": "stop"}]}
    body = b"data: " + msgspec.json.encode(chunk) + b"\n\ndata: [DONE]\n\n"
    return Response(body, media_type="text/event-stream")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
