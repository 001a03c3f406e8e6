"""The scheduler's link to its worker: plans out on a PUSH socket, results back on a PULL one,
and the handshake that lets either side restart.

Every (re)start sends a SchedulerHello with a fresh incarnation; the worker answers with a
WorkerReady naming it, and announces itself unasked when it starts. A WorkerReady with another
incarnation mid-run is a restarted worker (its steps and KV are gone), handed to `on_restart`.
A worker from another build is refused, and the api told why, until a compatible one appears.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from stoker.common.addresses import Addresses, bind_address
from stoker.common.ipc import encoder, worker_outbound_decoder
from stoker.common.messages import (
    EngineFailure,
    ProfileControl,
    SchedulerHello,
    StepPlan,
    StepResult,
    WorkerReady,
)
from stoker.common.wire_digest import PROTOCOL, check_peer

log = logging.getLogger("stoker.scheduler")
# While a worker from another build is refused, the api hears why this often (it may connect
# after the refusal).
REFUSAL_REPEAT_S = 2.0


class EngineStalled(Exception):
    """No step result for --step-timeout-s: the worker is hung, frozen or gone."""


def decode(raw: bytes) -> StepResult | WorkerReady | None:
    """A message from the worker; None (logged) for one that does not decode."""
    try:
        return worker_outbound_decoder.decode(raw)
    except msgspec.DecodeError:
        log.warning("dropped a malformed message from the worker (another build?)")
        return None


class WorkerLink:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        addresses: Addresses,
        step_timeout_s: float,
        tell_api: Callable[[EngineFailure], None],
        on_restart: Callable[[WorkerReady], None],
    ) -> None:
        self.plans = ctx.socket(zmq.PUSH)
        self.plans.bind(bind_address(addresses.worker_plan))
        self.results = ctx.socket(zmq.PULL)
        self.results.bind(bind_address(addresses.worker_result))
        self.step_timeout_s = step_timeout_s
        self._tell_api = tell_api
        self._on_restart = on_restart
        self.incarnation = ""  # of our last SchedulerHello
        self.lost = asyncio.Event()  # the worker's connection closed (it died)

    def monitor(self) -> zmq.asyncio.Socket:
        """Disconnect events of the plan socket, for `watch`; open it before the handshake, so a
        worker that dies meanwhile is noticed."""
        return self.plans.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    async def watch(self, monitor: zmq.asyncio.Socket, wakeup: asyncio.Event) -> None:
        """A worker that dies closes its connection: set `lost` (and wake the step loop), so
        what it held fails now rather than at the step timeout."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                log.error("the worker disconnected")
                self.lost.set()
                wakeup.set()

    async def send(self, msg: StepPlan | ProfileControl) -> None:
        await self.plans.send(encoder.encode(msg))

    async def handshake(self) -> WorkerReady:
        """Ask the worker to (re)announce itself and forget old requests; a worker that starts
        later announces itself unasked. Anything else on the result socket (results for a
        previous scheduler's plans) is dropped. Idempotent: either side may restart."""
        self.incarnation = incarnation = uuid.uuid4().hex
        await self.plans.send(encoder.encode(SchedulerHello(incarnation, PROTOCOL)))
        refused: str | None = None  # why the worker that answered cannot be served
        while True:
            if refused is None:
                raw = await self.results.recv()
            else:
                try:
                    raw = await asyncio.wait_for(self.results.recv(), REFUSAL_REPEAT_S)
                except TimeoutError:  # an api that connected since must hear it too
                    self._tell_api(EngineFailure(refused))
                    continue
            msg = decode(raw)
            if isinstance(msg, WorkerReady) and msg.incarnation in ("", incarnation):
                refused = self.refusal(msg)
                if refused is None:
                    return msg

    def refusal(self, ready: WorkerReady) -> str | None:
        """Why a worker cannot be served (None: it can). One from another build never is: the
        api is told (its /health and every request say why) until a compatible one appears."""
        problem = check_peer("worker", ready.protocol)
        if problem is not None:
            log.error("%s", problem)
            self._tell_api(EngineFailure(problem))
        return problem

    async def idle(self, wakeup: asyncio.Event) -> None:
        """Wait for wakeup; a worker that restarts meanwhile announces itself and is handed to
        on_restart now, not found out by the next request."""
        wake = asyncio.ensure_future(wakeup.wait())
        incoming = asyncio.ensure_future(self.results.poll())
        try:
            await asyncio.wait({wake, incoming}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            incoming.cancel()
        if await self.results.poll(0):  # nothing is in flight: no step result is due
            msg = decode(await self.results.recv())
            if isinstance(msg, WorkerReady) and msg.incarnation != self.incarnation:
                log.warning("the worker restarted: %d KV blocks", msg.num_blocks)
                self._on_restart(msg)

    async def next_result(self, step_id: int) -> StepResult | None:
        """The result of step_id; None when the worker was lost (`lost` is set) or a restarted
        one announced itself instead (handed to on_restart). Malformed or stale messages are
        dropped. Raises EngineStalled when the worker is silent for the step timeout."""
        while True:
            recv = asyncio.ensure_future(self.results.recv())
            lost = asyncio.ensure_future(self.lost.wait())
            done, _ = await asyncio.wait(
                {recv, lost}, timeout=self.step_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            lost.cancel()
            if recv not in done:
                recv.cancel()
                if self.lost.is_set():
                    return None  # the step loop recovers
                raise EngineStalled(f"the worker made no progress for {self.step_timeout_s:g} s")
            msg = decode(recv.result())
            if msg is None:
                continue
            if isinstance(msg, WorkerReady) and msg.incarnation == self.incarnation:
                continue  # its answer to our hello, after it had announced itself unasked
            if isinstance(msg, WorkerReady):
                self._on_restart(msg)
                return None
            if msg.step_id != step_id:
                log.warning("dropped a result for step %d (waiting for %d)", msg.step_id, step_id)
                continue
            return msg
