"""The scheduler's outbound side of its ROUTER: token batches to tokenizers, stats and engine
failures to the api, never dropped silently.

A tokenizer whose queue is full holds its batches here, in order, and the step loop plans no
step until it takes them (backpressure); one that is gone, or takes nothing for
TOKENIZER_STALL_S, is handed to `on_lost`, which fails its requests loudly.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from stoker.common.addresses import API_ROUTING_ID, bind_address
from stoker.common.ipc import encoder
from stoker.common.messages import EngineFailure, RequestTokens, SchedulerStats, TokenBatch

log = logging.getLogger("stoker.scheduler")
# Token batches queued for one tokenizer (one batch per step; its own receive queue holds about
# as many again). A full queue is backpressure: the batch waits in the scheduler, which plans no
# new step until the tokenizer takes it, so the pipeline runs at its slowest stage's pace (a
# null model or a fast GPU can outrun detokenization) instead of queueing seconds of tokens.
TOKENIZER_HWM = 1_000
# A tokenizer that takes none of its held batches for this long is stuck (frozen, or gone
# without closing its connection): its requests fail loudly, and planning resumes for the rest.
# The api's own deadline for a silent tokenizer is the same (STOKER_TOKENIZER_LOST_S).
TOKENIZER_STALL_S = 10.0


def bind_router(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    """The scheduler's ROUTER: requests in from tokenizers and the api, batches and stats out."""
    router = ctx.socket(zmq.ROUTER)
    # A batch for an unknown or full peer raises instead of vanishing (see send_now).
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, TOKENIZER_HWM)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted api reclaims its id
    router.bind(bind_address(address))
    return router


class TokenizerOutbox:
    def __init__(self, router: zmq.asyncio.Socket, on_lost: Callable[[bytes], None]) -> None:
        self.router = router
        self._on_lost = on_lost  # a tokenizer that is gone or stalled, by routing id
        # Frames a tokenizer's full queue did not take, in order, and when it last took one.
        # Never rebound, so the step loop may hold it: while it is non-empty no step is planned.
        self.backlog: dict[bytes, collections.deque[list[bytes]]] = {}
        self._moved: dict[bytes, float] = {}

    def send_items(self, items: dict[bytes, list[RequestTokens]]) -> None:
        self.send_batches({routing_id: TokenBatch(i) for routing_id, i in items.items()})

    def send_batches(self, batches: dict[bytes, TokenBatch]) -> None:
        lost: list[bytes] = []
        for routing_id, batch in batches.items():
            if not batch.items and not batch.steady_req_ids:
                continue
            frames = [routing_id, encoder.encode(batch)]
            backlog = self.backlog.get(routing_id)
            if backlog is not None:  # behind batches its queue did not take: keep the order
                backlog.append(frames)
                continue
            try:
                self.send_now(frames)
            except zmq.ZMQError as e:
                if e.errno == zmq.EAGAIN:  # its queue is full: hold the batch, plan no step
                    self.backlog[routing_id] = collections.deque([frames])
                    self._moved[routing_id] = time.monotonic()
                else:  # gone (EHOSTUNREACH)
                    log.error("tokenizer %s cannot take its tokens (%s)", routing_id.decode(), e)
                    lost.append(routing_id)
        for routing_id in lost:
            self._on_lost(routing_id)

    def flush(self) -> None:
        """Hand held batches on as their tokenizers' queues drain; give up on a tokenizer that
        took none for TOKENIZER_STALL_S, or that went away."""
        now = time.monotonic()
        stuck: list[bytes] = []
        for routing_id, backlog in self.backlog.items():
            try:
                while backlog:
                    self.send_now(backlog[0])
                    backlog.popleft()
                    self._moved[routing_id] = now
            except zmq.ZMQError as e:
                if e.errno != zmq.EAGAIN:
                    log.error("tokenizer %s cannot take its tokens (%s)", routing_id.decode(), e)
                    stuck.append(routing_id)
                elif now - self._moved[routing_id] > TOKENIZER_STALL_S:
                    log.error("tokenizer %s took no tokens for %.0f s", routing_id.decode(),
                              TOKENIZER_STALL_S)  # fmt: skip
                    stuck.append(routing_id)
        for routing_id in [r for r, b in self.backlog.items() if not b] + stuck:
            del self.backlog[routing_id], self._moved[routing_id]
        for routing_id in stuck:
            self._on_lost(routing_id)

    def send_api(self, msg: SchedulerStats | EngineFailure) -> None:
        try:
            self.send_now([API_ROUTING_ID, encoder.encode(msg)])
        except zmq.ZMQError as e:  # the api is not connected (yet): stats come again shortly
            log.debug("could not reach the api: %s", e)

    def send_now(self, frames: list[bytes]) -> None:
        """Send on the router without waiting; raise zmq.ZMQError if the peer is unknown or full.

        Through the asyncio socket, never a sync shadow of it: ZMQ's read wakeup is edge
        triggered, and a send on a shadow can consume the edge that would have woken the pending
        recv, leaving requests unread in the socket until some other message arrives."""
        sent = self.router.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        assert isinstance(sent, asyncio.Future)  # an asyncio socket's send is a future
        error = sent.exception() if sent.done() else None
        if error is not None:
            raise error
