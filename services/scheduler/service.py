"""The scheduler process: one asyncio loop around the scheduler core. It only schedules.

Inbound (ROUTER): GenerateRequest and Abort from tokenizers, Abort from the api.
Outbound: StepPlans to the worker; per step, one TokenBatch per owning tokenizer; SchedulerStats
to the api. With overlap on, plan N+1 is sent before result N arrives (requests that will
sample in step N are assumed to continue), so the worker never waits on this loop.

This module is the step loop and request bookkeeping; the worker's sockets, handshake and
restarts are `worker_link.py`, the ROUTER's outbound side with its backpressure is
`tokenizer_outbox.py`, token batches and stats are `publish.py`, the request checks
`admission.py`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from pathlib import Path

import msgspec
import zmq.asyncio

from stoker.common.addresses import API_ROUTING_ID, Addresses
from stoker.common.config import EngineConfig
from stoker.common.fairness import let_others_run
from stoker.common.ipc import scheduler_inbound_decoder
from stoker.common.messages import (
    Abort,
    EngineFailure,
    GenerateRequest,
    ProfileControl,
    RequestTokens,
    SchedulerStats,
    StepPlan,
    WorkerReady,
    unpack_ids,
)
from stoker.common.model_config import ModelConfig
from stoker.common.profiling import Profiler, control, span
from stoker.services.scheduler.admission import Admission, arrival_monotonic
from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.config import SchedulerConfig
from stoker.services.scheduler.kv_events import make_publisher
from stoker.services.scheduler.publish import Owner, StepStats, token_batches
from stoker.services.scheduler.scheduler import Scheduler
from stoker.services.scheduler.speculation import SpecPolicy
from stoker.services.scheduler.tokenizer_outbox import TokenizerOutbox, bind_router
from stoker.services.scheduler.worker_link import WorkerLink

log = logging.getLogger("stoker.scheduler")
STATS_INTERVAL_S = 0.25
BACKLOG_POLL_S = 0.001  # how often a step loop held back by a tokenizer's backlog retries
EXIT_STALLED = 3  # the worker made no progress for --step-timeout-s


class SchedulerService:
    def __init__(
        self,
        config: EngineConfig,
        addresses: Addresses,
        overlap: bool = True,
        step_timeout_s: float = 60.0,
        profile_dir: str | None = None,
    ) -> None:
        self.config = config
        self.model_name = Path(config.model).name
        self.model_cfg = ModelConfig.from_folder(config.model)
        self.depth = 2 if overlap else 1  # plans in flight
        self.ctx = zmq.asyncio.Context()
        self.router = bind_router(self.ctx, addresses.scheduler)
        self.outbox = TokenizerOutbox(self.router, self._fail_tokenizer)
        self.link = WorkerLink(
            self.ctx, addresses, step_timeout_s, self.outbox.send_api, self._restarted
        )
        self.owners: dict[str, Owner] = {}
        self.wakeup = asyncio.Event()
        self.stats_due = asyncio.Event()
        self.step_stats = StepStats()
        self.scheduler: Scheduler | None = None
        self.blocks: BlockManager | None = None
        self.admission: Admission | None = None
        self.max_model_len = 0
        self.worker_ready = False
        # Requests that arrive while a lost worker is replaced join the new core once it is up.
        self._pending: list[tuple[bytes, GenerateRequest]] = []
        self.kv_events = make_publisher(config.kv_events_config)  # None: no events recorded
        self.profiler = Profiler(profile_dir, "scheduler")

    async def run(self) -> None:
        monitor = self.link.monitor()
        self._start(await self.link.handshake())
        log.info(
            "scheduler ready: %d blocks, max_model_len %d",
            self.blocks.num_blocks if self.blocks else 0,
            self.max_model_len,
        )
        await asyncio.gather(
            self._inbound_loop(),
            self._step_loop(),
            self._stats_loop(),
            self.link.watch(monitor, self.wakeup),
        )

    async def _recover(self) -> None:
        """Fail every request, then handshake with whichever worker comes next and serve on."""
        self.worker_ready = False
        self.link.lost.clear()
        self._fail_all("the worker was lost; the request failed")
        self.stats_due.set()
        self._start(await self.link.handshake())
        pending, self._pending = self._pending, []
        for routing_id, msg in pending:
            self._add(routing_id, msg)
        log.warning("serving again: %d KV blocks", self.blocks.num_blocks if self.blocks else 0)
        self.stats_due.set()

    def _restarted(self, ready: WorkerReady) -> None:
        """A restarted worker announced itself: every request is lost. Serve it on its blocks,
        or, from another build, wait in the handshake for one that can be served."""
        self._fail_all("the worker restarted; the request was lost")
        if self.link.refusal(ready) is None:
            self._start(ready)
        else:
            self.link.lost.set()
        self.stats_due.set()

    def _start(self, ready: WorkerReady) -> None:
        self.worker_ready = True
        self.max_model_len = ready.max_model_len
        self.blocks = BlockManager(
            ready.num_blocks,
            ready.block_size,
            self.config.enable_prefix_caching,
            record_events=self.kv_events is not None,
        )
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine(self.config, ready.max_model_len),
            self.blocks,
            SpecPolicy.from_config(self.config),
        )
        self.admission = Admission(self.scheduler, self.blocks, ready.max_model_len, self.model_cfg)
        self.owners = {}

    def _fail_all(self, message: str) -> None:
        """Every request is lost (the worker stalled or restarted): tell each owning tokenizer
        (it drops their state) and the api (it answers 503 / an SSE error event)."""
        self.outbox.send_api(EngineFailure(message))  # first: the api answers before tokenizers
        replies: dict[bytes, list[RequestTokens]] = collections.defaultdict(list)
        for req_id, owner in self.owners.items():
            replies[owner.routing_id].append(
                RequestTokens(req_id, b"", finish_reason="abort", error=message, error_status=503)
            )
        num_failed = len(self.owners)
        self.owners = {}
        self.outbox.send_items(replies)
        log.error("engine failure: %s (%d requests failed)", message, num_failed)

    def _fail_tokenizer(self, routing_id: bytes) -> None:
        """A tokenizer that is gone or cannot keep up: abort its requests (freeing their
        blocks) and have the api fail them, rather than starve them."""
        assert self.scheduler is not None
        ids = [r for r, o in self.owners.items() if o.routing_id == routing_id]
        for req_id in ids:
            self.scheduler.abort(req_id)
            del self.owners[req_id]
        if ids:
            name = routing_id.decode(errors="replace")
            self.outbox.send_api(EngineFailure(f"tokenizer {name} fell behind or went away", ids))
            self.stats_due.set()

    # -- inbound ----------------------------------------------------------------------------------

    async def _inbound_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames)} frames, expected 2")
                routing_id, raw = frames
                msg = scheduler_inbound_decoder.decode(raw)
            except (ValueError, msgspec.DecodeError) as e:  # never end the loop over one message
                log.warning("dropped a malformed inbound message: %s", e)
                continue
            if isinstance(msg, GenerateRequest):
                if self.worker_ready:
                    self._add(routing_id, msg)
                else:
                    self._pending.append((routing_id, msg))
            elif isinstance(msg, Abort):
                if self._pending:
                    gone = set(msg.req_ids)
                    self._pending = [p for p in self._pending if p[1].req_id not in gone]
                self._abort(msg)
            elif isinstance(msg, ProfileControl):
                await self._profile(routing_id, msg)
            self.wakeup.set()
            await let_others_run()  # a burst of requests must not hold up the step loop

    async def _profile(self, routing_id: bytes, msg: ProfileControl) -> None:
        """Only the api may switch the profiler; the worker gets it on the plan socket, in
        order with the plans."""
        if routing_id != API_ROUTING_ID or not self.profiler.enabled:
            log.warning("dropped a profile control from %r", routing_id)
            return
        if control(self.profiler, msg):
            await self.link.send(msg)

    def _add(self, routing_id: bytes, msg: GenerateRequest) -> None:
        assert self.admission is not None
        try:
            prompt = unpack_ids(msg.prompt_token_ids)
            self.admission.add(msg.req_id, prompt, msg.params, arrival_monotonic(msg.arrival_time))
        except ValueError as e:
            log.info("rejected: %s", e, extra={"request_id": msg.req_id})
            reply = RequestTokens(msg.req_id, b"", finish_reason="abort", error=str(e))
            self.outbox.send_items({routing_id: [reply]})
            return
        self.owners[msg.req_id] = Owner(routing_id)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("admitted: %d prompt tokens", len(prompt), extra={"request_id": msg.req_id})

    def _abort(self, msg: Abort) -> None:
        assert self.scheduler is not None
        replies: dict[bytes, list[RequestTokens]] = collections.defaultdict(list)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("abort (%s)", msg.reason, extra={"request_ids": msg.req_ids})
        for req_id in msg.req_ids:
            if self.scheduler.abort(req_id):
                owner = self.owners.pop(req_id, None)
                if owner is not None and msg.reason == "abort":
                    replies[owner.routing_id].append(
                        RequestTokens(req_id, b"", finish_reason="abort")
                    )
        self.outbox.send_items(replies)
        self.stats_due.set()

    # -- steps ------------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        assert self.scheduler is not None
        inflight: collections.deque[StepPlan] = collections.deque()
        # Bound once: none of these is ever rebound (the core is, on a restart: self.scheduler).
        link, lost, outbox, backlog = self.link, self.link.lost, self.outbox, self.outbox.backlog
        telemetry, idle_gaps = self.step_stats.telemetry, self.step_stats.idle_gaps
        while True:
            if lost.is_set():
                inflight.clear()
                await self._recover()
                continue
            if backlog:
                outbox.flush()
            if len(inflight) < self.depth and not backlog:
                t0, c0 = time.perf_counter(), time.thread_time()
                with span("schedule"):
                    plan = self.scheduler.schedule()
                t1, c1 = time.perf_counter(), time.thread_time()
                if plan.num_requests or plan.finished_req_ids:
                    plan.sent_at = time.time()
                    idle_gaps.plan_sent(plan.step_id)
                    await link.send(plan)
                    inflight.append(plan)
                    telemetry.observe("schedule", t1 - t0)
                    telemetry.observe("schedule_cpu", c1 - c0)
                    telemetry.observe("plan_encode", time.perf_counter() - t1)
                    if plan.num_requests and len(inflight) < self.depth:
                        continue  # plan the next step before waiting on this one
            if inflight:
                result = await link.next_result(inflight[0].step_id)
                if result is None:  # the worker restarted or was lost: its steps and KV are gone
                    inflight.clear()
                    continue
                t0 = time.perf_counter()
                plan = inflight.popleft()
                with span("update"):
                    updates = self.scheduler.update(plan, result)
                    outbox.send_batches(token_batches(updates, self.owners))
                if self.kv_events is not None:  # once per step, after its blocks are computed
                    assert self.blocks is not None  # set with the worker, before any step
                    self.kv_events.publish(self.blocks.take_events())
                self.step_stats.record(result, time.perf_counter() - t0)
                if self.profiler.active:
                    self.profiler.step()
                if not self.scheduler.has_unfinished():
                    self.stats_due.set()
                continue
            if backlog:  # a tokenizer is behind: no new step until it catches up
                await asyncio.sleep(BACKLOG_POLL_S)
                continue
            idle_gaps.engine_idle()
            self.wakeup.clear()
            await link.idle(self.wakeup)

    # -- stats ------------------------------------------------------------------------------------

    async def _stats_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stats_due.wait(), STATS_INTERVAL_S)
            self.stats_due.clear()
            self.outbox.send_api(self.stats())

    def stats(self) -> SchedulerStats:
        assert self.scheduler is not None and self.blocks is not None
        return self.step_stats.snapshot(
            self.scheduler, self.blocks, self.worker_ready, self.max_model_len, self.model_name
        )
