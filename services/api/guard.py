"""Access control: `--api-key` as an ASGI middleware in front of every route.

Every path needs `Authorization: Bearer KEY` except /health (for probes), /metrics (unless
--protect-metrics), and /dashboard, which is served ahead of this middleware: the page holds no
data, and with --protect-metrics it asks for the key to read /metrics with. The comparison is
constant-time (hmac.compare_digest), so the response time says nothing about how much of a
guessed key was right.
"""

from __future__ import annotations

import hmac

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from stoker.services.api.openai_schema import ApiError


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = {"/health"} | (set() if protect_metrics else {"/metrics"})

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            return await self.app(scope, receive, send)
        if self.authorized(scope["headers"]):
            return await self.app(scope, receive, send)
        error = ApiError(
            "Incorrect API key provided: pass it as `Authorization: Bearer KEY`",
            status=401,
            code="invalid_api_key",
        )
        body = msgspec.json.encode(error.body())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="stoker"'),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
