"""The fleet's front door: clients' requests reach smg, and through it a replica, byte for byte.

smg 1.13 parses a /v1/completions or /v1/chat/completions body into its own types before it
routes, unless it can choose a replica without reading the body; then it forwards the client's
bytes verbatim. Parsed, a body loses what smg's types cannot hold or do not allow: a prompt of
token ids, top_k 0, a fifth stop string, false and null fields (docs/fleet.md, "What reaches the
replicas"). smg routes without reading the body when an `x-smg-routing-tokens` header names the
prompt's tokens, and streams the body on when it may not keep it for a retry
(`--max-buffered-request-bytes 0`, set by plan.router_command).

So this front adds that header to every generation request: a token-id prompt's own ids, else ids
hashed from 4-character chunks of the prompt's text, which keep cache_aware routing by prefix as
it does on text. Everything else passes through untouched. smg does not retry a request it
streams, so the front does: one that smg could not deliver (connection refused, or broken before
any answer) is sent again until RETRY_BUDGET_S after the first failure, by when smg's health
checks have taken a dead replica out.
"""

from __future__ import annotations

import argparse
import asyncio
import zlib

import aiohttp
import msgspec
import uvloop
from aiohttp import web
from multidict import CIMultiDict

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
HINT = "x-smg-routing-tokens"
HINT_MAX_IDS, HINT_MAX_BYTES = 512, 4096  # smg ignores a hint past either
CHARS_PER_ID = 4  # smg's own guess at characters per token (its prefix_hash policy)
TEXT_ID_MOD = 10_000_000  # 7 digits: 512 ids and their commas fit in 4096 bytes
MAX_BODY = 512 * 2**20  # smg's default --max-payload-size; the replica applies its own limit
# smg's codes for a replica it could not reach or that broke before answering.
RETRY_CODES = frozenset({"call_upstream_connection_failed", "call_upstream_request_error"})
RETRY_BUDGET_S = 10.0  # smg marks a dead replica after 2 failed checks 2 s apart (plan.py)
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)  # fmt: skip


def routing_hint(body: bytes) -> str:
    """The `x-smg-routing-tokens` value for a generation request's body; never empty, so smg
    forwards even a body the replica will refuse, and the client gets the replica's answer."""
    try:
        req = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # deep nesting: the replica answers it
        req = None
    ids = _prompt_ids(req) or _text_ids(_prompt_text(req)) or [0]
    out: list[str] = []
    size = -1
    for i in ids[:HINT_MAX_IDS]:
        size += len(str(i)) + 1
        if size > HINT_MAX_BYTES:
            break
        out.append(str(i))
    return ",".join(out)


def _prompt_ids(req: object) -> list[int] | None:
    prompt = req.get("prompt") if isinstance(req, dict) else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch: route on its first prompt
    if isinstance(prompt, list) and prompt and all(_is_u32(t) for t in prompt):
        return prompt
    return None


def _is_u32(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32


def _prompt_text(req: object) -> str:
    if not isinstance(req, dict):
        return ""
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    messages = req.get("messages")
    parts: list[str] = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            content = "".join(t for t in texts if isinstance(t, str))
        parts.append(f"{m.get('role')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def _text_ids(text: str) -> list[int]:
    """One id per 4 characters from the start, so prompts that share a prefix share a prefix of
    ids (crc32: the same ids across restarts of the front)."""
    text, n = text[: HINT_MAX_IDS * CHARS_PER_ID], CHARS_PER_ID
    return [zlib.crc32(text[i : i + n].encode()) % TEXT_ID_MOD for i in range(0, len(text), n)]


class Front:
    def __init__(self, router_url: str) -> None:
        self.router_url = router_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        # No pool cap (smg bounds concurrency), no timeout (a long generation is not an error),
        # bytes as they come (no decompression), no headers the client did not send.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP
        )
        generation = request.method == "POST" and request.path in GENERATE_PATHS
        if generation:
            headers[HINT] = routing_hint(body)  # replaces any the client sent
        retry = generation or request.method in ("GET", "HEAD")
        upstream = await self._send(request, headers, body, retry)
        if upstream is None:
            message = "the fleet's router (smg) is unreachable"
            error = {"message": message, "type": "server_error", "code": "router_unreachable"}
            return web.json_response({"error": error}, status=502)
        return await self._relay(request, upstream)

    async def _send(
        self, request: web.Request, headers: CIMultiDict, body: bytes, retry: bool
    ) -> aiohttp.ClientResponse | None:
        assert self.session is not None
        url = self.router_url + request.raw_path
        loop = asyncio.get_running_loop()
        deadline, delay = None, 0.05
        while True:
            try:
                upstream = await self.session.request(
                    request.method, url, headers=headers, data=body, allow_redirects=False
                )
                failed = upstream.headers.get("x-smg-error-code") in RETRY_CODES
            except aiohttp.ClientConnectionError:  # smg down, or a stale pooled connection
                upstream, failed = None, True
            if not (failed and retry):
                return upstream
            deadline = deadline or loop.time() + RETRY_BUDGET_S
            if loop.time() + delay > deadline:
                return upstream
            if upstream is not None:
                upstream.release()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                response.headers.add(k, v)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # SSE events as they come
                await response.write(chunk)
            await response.write_eof()
        except BaseException:
            # The client left (or the handler was cancelled): closing the connection to smg
            # is what tells the replica to abort the request, as a direct client's leaving does.
            upstream.close()
            raise
        upstream.release()
        return response


def build_app(router_url: str) -> web.Application:
    front = Front(router_url)
    app = web.Application(client_max_size=MAX_BODY)
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.stop)
    app.router.add_route("*", "/{tail:.*}", front.handle)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--router", required=True, help="smg's URL, e.g. http://127.0.0.1:8003")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain, seconds")
    args = parser.parse_args(argv)
    # handler_cancellation: a handler is cancelled when its client disconnects, so the request
    # upstream is dropped with it. SIGTERM: requests in flight get --shutdown-timeout to finish.
    web.run_app(
        build_app(args.router), host=args.host, port=args.port, handler_cancellation=True,
        shutdown_timeout=args.shutdown_timeout, print=None, access_log=None,
        loop=uvloop.new_event_loop(),
    )  # fmt: skip


if __name__ == "__main__":
    main()
