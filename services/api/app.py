"""The OpenAI-compatible HTTP front end (Starlette).

A handler decodes and checks the body, fans the call out into n sub-requests, and reads their
deltas from one queue fed by the EngineClient. Streaming responses wait for the first delta
before sending headers, so a tokenizer-side rejection (prompt too long) is still a 400. A client
that goes away aborts its sub-requests at once, so the scheduler frees their KV blocks.

(Past 400 lines on purpose: the Api class holds every route's handler over one EngineClient and
one Formatter; the other routes' families already live apart: tokenize_routes.py,
dashboard_routes.py, router_routes.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from stoker.common.messages import ProfileControl, TextDelta
from stoker.common.tokenizer_files import chat_template_text
from stoker.common.tool_calls import detect_format
from stoker.services.api import generation, openai_schema
from stoker.services.api.config import ApiConfig
from stoker.services.api.dashboard_routes import DashboardPage
from stoker.services.api.delta_queue import DeltaQueue
from stoker.services.api.engine_client import EngineClient
from stoker.services.api.guard import ApiKeyMiddleware
from stoker.services.api.openai_schema import ApiError
from stoker.services.api.openapi import openapi_document
from stoker.services.api.responses import Accumulator, Formatter
from stoker.services.api.router_routes import version
from stoker.services.api.tokenize_routes import TokenIdStrings, TokenizerEndpoints
from stoker.services.api.tokens import TokenStrings
from stoker.services.api.tool_output import ToolOutput

log = logging.getLogger("stoker.api")


class ProfileRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The optional body of POST /start_profile."""

    num_steps: int | None = None  # stop on its own after this many engine steps
    record_shapes: bool = False
    with_stack: bool = False


class _Json(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Streams events until done or the client disconnects; then always calls on_close (which
    aborts whatever is still running), however the stream ended. Watching for the disconnect
    ourselves (not relying on a failed send) makes the abort prompt even while no token flows."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._events, self._on_close = events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._on_close()
            for t in (pump, watcher):
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(pump, watcher, return_exceptions=True)
            with contextlib.suppress(BaseException):
                await self._events.aclose()  # type: ignore[attr-defined]
        error = pump.exception() if pump.done() and not pump.cancelled() else None
        if error is not None and not isinstance(error, OSError):  # OSError: the client left
            log.error("stream failed", exc_info=error)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


_DISCONNECTED = object()


async def _race_disconnect(coro: Any, request: Request) -> Any:
    """The coroutine's result, or _DISCONNECTED if the client goes away first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
    return task.result() if task.done() and not task.cancelled() else _DISCONNECTED


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = ApiError(f"the request body exceeds {limit} bytes", status=413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class Api:
    def __init__(self, client: EngineClient, config: ApiConfig, strings: TokenStrings) -> None:
        self.client, self.config, self.strings = client, config, strings
        self.draining = False  # SIGTERM: new requests get 503, those in flight may finish
        self.streams = 0  # SSE responses still being written
        self._openapi = msgspec.json.encode(
            openapi_document(config.limits, secured=config.api_key is not None)
        )
        # Once, from the template text: the tokenizers detect the same (TokenizeRequest names it).
        self.tool_format = detect_format(
            chat_template_text(config.model_path), config.tool_call_format
        )
        self.tokens = TokenizerEndpoints(
            config.model_path,
            config.served_model_name,
            lambda: self.client.stats.max_model_len if self.client.stats else None,
            self.tool_format.name,
        )

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting, let what is in flight finish for up to timeout_s, then end the rest
        with an error (a 503, or an SSE error event and [DONE])."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.client.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failed = self.client.fail(None, "the server is shutting down", 503)
        if failed:
            log.warning("shutdown: ended %d requests still in flight", len(failed))
        for _ in range(40):  # give their handlers a moment to write the error out
            if not self.client.num_inflight and not self.streams:
                break
            await asyncio.sleep(0.05)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: Literal["completion", "chat"]) -> Response:
        if self.draining:
            raise ApiError(
                "the server is shutting down", status=503, type="server_error", code="shutting_down"
            )
        try:
            body = await _read_body(request, self.config.max_request_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        limits = self.config.limits
        if kind == "completion":
            req = openai_schema.decode(body, openai_schema.CompletionRequest)
            gen = generation.completion_generation(req, limits)
        else:
            req = openai_schema.decode(body, openai_schema.ChatRequest)
            gen = generation.chat_generation(req, limits, self.tool_format)
        strings: Any = TokenIdStrings() if req.return_tokens_as_token_ids else self.strings
        name = self.config.served_model_name
        if gen.model is not None and gen.model != name:
            raise ApiError(
                f"The model `{gen.model}` does not exist.",
                status=404,
                param="model",
                code="model_not_found",
            )
        req_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        subs = gen.sub_requests(req_id, time.time())
        ids = [s.req_id for s in subs]
        acc = Accumulator(req_id, gen.n, whole=not gen.stream, shown=gen.shown)
        tools = None
        if gen.tools.parse:
            tools = ToolOutput(self.tool_format, req_id, gen.tools.parallel, gen.tools.legacy)
        with_logprobs = gen.params.logprobs is not None
        fmt = Formatter(kind, req_id, name, strings, with_logprobs, tools, gen.shown)
        queue = await self.client.submit(subs)
        timer = self._deadline(ids)
        streaming = False
        try:
            first = await _race_disconnect(queue.get(), request)
            if first is _DISCONNECTED:
                return Response(status_code=499)
            if first.error is not None:
                if first.error_status != 400:  # the server lost it (e.g. its tokenizer died)
                    raise ApiError(first.error, status=first.error_status, type="server_error")
                raise ApiError(first.error, param=_error_param(first.error, kind))
            if gen.stream:
                streaming = True  # from here the SSE response owns the release

                def on_close() -> None:
                    self.streams -= 1
                    if timer is not None:
                        timer.cancel()
                    self.client.release(ids)

                events = self._events(first, queue, acc, fmt, gen)
                self.streams += 1
                return SSEResponse(events, on_close=on_close)
            done = await _race_disconnect(self._collect(first, queue, acc), request)
            if done is _DISCONNECTED:
                return Response(status_code=499)
            if acc.error is not None or acc.aborted:
                status = acc.error_status if acc.error is not None else 500
                raise ApiError(
                    acc.error or "the request was aborted by the server",
                    status=status,
                    type="server_error" if status in (503, 504) else "internal_server_error",
                )
            return _Json(fmt.response(acc))
        finally:
            if not streaming:
                if timer is not None:
                    timer.cancel()
                self.client.release(ids)

    def _deadline(self, ids: list[str]) -> asyncio.TimerHandle | None:
        """--request-timeout-s: past it the request ends with a 504 (or an SSE error event) and
        is aborted upstream, which frees its KV blocks."""
        timeout = self.config.request_timeout_s
        if timeout is None:
            return None
        message = f"the request did not finish within --request-timeout-s {timeout:g}"
        return asyncio.get_running_loop().call_later(timeout, self.client.fail, ids, message, 504)

    @staticmethod
    async def _collect(first: TextDelta, queue: DeltaQueue, acc: Accumulator) -> bool:
        acc.add(first)
        while not acc.done:
            acc.add(await queue.get())
        return True

    @staticmethod
    async def _events(
        first: TextDelta,
        queue: DeltaQueue,
        acc: Accumulator,
        fmt: Formatter,
        gen: generation.Generation,
    ) -> AsyncIterator[bytes]:
        if fmt.kind == "chat":
            for i in range(gen.n):
                yield _sse(fmt.role_chunk(i))
        pending = [first]
        add = acc.add
        while True:
            # A client that fell behind gets everything queued since as one event per choice.
            groups: dict[int, list[TextDelta]]
            if gen.n == 1:
                for d in pending:
                    add(d)
                groups = {0: pending}
            else:
                groups = {}
                for d in pending:
                    groups.setdefault(add(d).index, []).append(d)
            for index, deltas in groups.items():
                chunk = fmt.chunk(acc.choices[index], deltas)
                if chunk is not None:
                    yield _sse(chunk)
            if acc.done:
                break
            pending = await queue.get_all()
        if acc.error is not None or acc.aborted:
            error = ApiError(acc.error or "the request was aborted by the server", status=500)
            kind = "server_error" if acc.error_status in (503, 504) else "internal_server_error"
            yield _sse({"error": {**error.body()["error"], "type": kind}})
        if gen.include_usage:
            yield _sse(fmt.usage_chunk(acc))
        yield b"data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        stats = self.client.stats
        card = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "stoker",
            "root": self.config.served_model_name,  # never a filesystem path
            "max_model_len": stats.max_model_len if stats else None,
        }
        return _Json({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        ok, reason = self.client.health()
        return Response(status_code=200) if ok else _Json({"status": reason}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.client.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def debug_state(self, request: Request) -> Response:
        return _Json(self.client.state())

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi, media_type="application/json")

    async def tokenize(self, request: Request) -> Response:
        return _Json(await self.tokens.tokenize(await self._small_body(request)))

    async def detokenize(self, request: Request) -> Response:
        return _Json(await self.tokens.detokenize(await self._small_body(request)))

    async def start_profile(self, request: Request) -> Response:
        self._check_profiling(request)
        body = await self._small_body(request)
        req = openai_schema.decode(body, ProfileRequest) if body.strip() else ProfileRequest()
        if req.num_steps is not None and req.num_steps < 1:
            raise ApiError("num_steps must be at least 1", param="num_steps")
        msg = ProfileControl("start", req.num_steps or 0, req.record_shapes, req.with_stack)
        self.client.send_control(msg)
        return _Json({"status": "started", "profile_dir": self.config.profile_dir, **_fields(req)})

    async def stop_profile(self, request: Request) -> Response:
        self._check_profiling(request)
        self.client.send_control(ProfileControl("stop"))
        return _Json({"status": "stopped", "profile_dir": self.config.profile_dir})

    def _check_profiling(self, request: Request) -> None:
        if self.config.profile_dir is None:
            raise ApiError(
                f"{request.method} {request.url.path}: profiling is off (start the server with "
                "--profile-dir DIR)",
                status=404,
                type="not_found_error",
            )

    async def _small_body(self, request: Request) -> bytes:
        try:
            return await _read_body(request, self.config.max_request_bytes)
        except ClientDisconnect:
            raise ApiError("the client went away", status=499) from None


def _fields(req: ProfileRequest) -> dict[str, Any]:
    return {f: getattr(req, f) for f in req.__struct_fields__}


def _error_param(message: str, kind: str) -> str:
    """Best guess at which parameter a tokenizer/scheduler rejection is about."""
    for param in ("max_tokens", "logit_bias"):
        if param in message:
            return param
    return "messages" if kind == "chat" else "prompt"


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    # A 503 is temporary (overload, shutdown, an engine restart): say when to come back.
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return _Json(exc.body(), status_code=exc.status, headers=headers)


RETRY_AFTER_S = 1


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    err = ApiError(message, status=exc.status_code, type=kind)
    return _Json(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    err = ApiError(f"internal error: {exc}", status=500, type="internal_server_error")
    return _Json(err.body(), status_code=500)


def build_app(client: EngineClient, config: ApiConfig, strings: TokenStrings) -> Starlette:
    api = Api(client, config, strings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        # `stoker serve` sends SIGUSR1 when the worker or scheduler exits: fail what is in
        # flight at once, before the launcher stops the set.
        loop = asyncio.get_running_loop()
        message = "a worker or scheduler process exited"
        loop.add_signal_handler(signal.SIGUSR1, client.engine_lost, message)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
            await client.close()

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/debug/state", api.debug_state, methods=["GET"]),
        Route("/openapi.json", api.openapi, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/start_profile", api.start_profile, methods=["POST"]),
        Route("/stop_profile", api.stop_profile, methods=["POST"]),
        Route("/version", version, methods=["GET"]),  # SMG reads it to identify the engine
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.api = api
    if config.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=config.api_key, protect_metrics=config.protect_metrics
        )
    app.add_middleware(DashboardPage)  # added last, so outermost: the page needs no key
    return app
