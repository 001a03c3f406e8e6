"""uvicorn's Server with a draining SIGTERM: stop admitting (503 with Retry-After), let the
requests in flight finish for up to --shutdown-timeout seconds, end the rest with an error, then
exit 0. A second SIGTERM or SIGINT exits at once."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from stoker.services.api.app import Api

log = logging.getLogger("stoker.api")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, api: Api, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.api, self.shutdown_timeout_s = api, shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown, and the
        # process would end by the signal instead of exiting 0.
        if self._drain_task is not None or self._loop is None or not self.started:
            self.should_exit = True
            return
        log.warning("shutting down: draining for up to %g s", self.shutdown_timeout_s)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.api.drain(self.shutdown_timeout_s)
        finally:
            self.should_exit = True
