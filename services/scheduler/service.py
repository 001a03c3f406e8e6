"""The scheduler process: one asyncio loop around the scheduler core. It only schedules.

Inbound (ROUTER): GenerateRequest and Abort from tokenizers, Abort from the api.
Outbound: StepPlans to the worker; per step, one TokenBatch per owning tokenizer; SchedulerStats
to the api. With overlap on, plan N+1 is sent before result N arrives (requests that will
sample in step N are assumed to continue), so the worker never waits on this loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.addresses import API_ROUTING_ID, Addresses, bind_address
from common.config import EngineConfig
from common.fairness import let_others_run
from common.ipc import encoder, scheduler_inbound_decoder, worker_outbound_decoder
from common.messages import (
    Abort,
    EngineFailure,
    GenerateRequest,
    ProfileControl,
    RequestTokens,
    SchedulerHello,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenBatch,
    WorkerReady,
    pack_ids,
    unpack_ids,
)
from common.model_config import ModelConfig
from common.profiling import Profiler, span
from common.protocol import PROTOCOL, check_peer
from common.telemetry import BusyTracker, IdleGapAccounting, StepTelemetry
from common.validation import check_request
from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_events import make_publisher
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from services.scheduler.speculation import SpecPolicy

log = logging.getLogger("stoker.scheduler")
STATS_INTERVAL_S = 0.25
# Token batches queued for one tokenizer (one batch per step; its own receive queue holds about
# as many again). A full queue is backpressure: the batch waits in the scheduler, which plans no
# new step until the tokenizer takes it, so the pipeline runs at its slowest stage's pace (a
# null model or a fast GPU can outrun detokenization) instead of queueing seconds of tokens.
TOKENIZER_HWM = 1_000
# A tokenizer that takes none of its held batches for this long is stuck (frozen, or gone
# without closing its connection): its requests fail loudly, and planning resumes for the rest.
# The api's own deadline for a silent tokenizer is the same (STOKER_TOKENIZER_LOST_S).
TOKENIZER_STALL_S = 10.0
BACKLOG_POLL_S = 0.001
# While a worker from another build is refused, the api hears why this often (it may connect
# after the refusal).
REFUSAL_REPEAT_S = 2.0
EXIT_STALLED = 3  # the worker made no progress for --step-timeout-s


def arrival_monotonic(wall: float) -> float | None:
    """The api's arrival (time.time(), comparable across processes and hosts) on this process's
    monotonic clock, which the core measures queue time with; None (now) when the peer did not
    set it. A clock skew that puts it in the future counts as now."""
    if wall <= 0.0:
        return None
    return time.monotonic() - max(0.0, time.time() - wall)


class EngineStalled(Exception):
    """No step result for --step-timeout-s: the worker is hung, frozen or gone."""


class _Owner:
    __slots__ = ("routing_id", "announced")

    def __init__(self, routing_id: bytes) -> None:
        self.routing_id = routing_id
        self.announced = False  # the first RequestTokens carries prompt/cache/queue figures


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
        self.step_timeout_s = step_timeout_s
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        # A batch for an unknown or full peer raises instead of vanishing (see _send_now).
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, TOKENIZER_HWM)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted api reclaims its id
        self.router.bind(bind_address(addresses.scheduler))
        self.plans = self.ctx.socket(zmq.PUSH)
        self.plans.bind(bind_address(addresses.worker_plan))
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(bind_address(addresses.worker_result))
        self.owners: dict[str, _Owner] = {}
        # Frames a tokenizer's full queue did not take, in order, and when it last took one.
        self._backlog: dict[bytes, collections.deque[list[bytes]]] = {}
        self._backlog_moved: dict[bytes, float] = {}
        self.wakeup = asyncio.Event()
        self.stats_due = asyncio.Event()
        self.telemetry = StepTelemetry.empty()
        self.busy = BusyTracker()
        self.idle_gaps = IdleGapAccounting()
        self.scheduler: Scheduler | None = None
        self.blocks: BlockManager | None = None
        self.max_model_len = 0
        self.incarnation = ""  # of our last SchedulerHello
        self.worker_ready = False
        self.worker_lost = asyncio.Event()  # the worker's connection closed (it died)
        # Requests that arrive while a lost worker is replaced join the new core once it is up.
        self._pending: list[tuple[bytes, GenerateRequest]] = []
        self.kv_events = make_publisher(config.kv_events_config)  # None: no events recorded
        self.profiler = Profiler(profile_dir, "scheduler")

    async def run(self) -> None:
        monitor = self.plans.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._start(await self._handshake())
        log.info(
            "scheduler ready: %d blocks, max_model_len %d",
            self.blocks.num_blocks if self.blocks else 0,
            self.max_model_len,
        )
        await asyncio.gather(
            self._inbound_loop(), self._step_loop(), self._stats_loop(), self._watch(monitor)
        )

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """A worker that dies closes its connection: fail what it held and wait for the next
        one now, rather than at the step timeout."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                log.error("the worker disconnected")
                self.worker_lost.set()
                self.wakeup.set()

    async def _recover(self) -> None:
        """Fail every request, then handshake with whichever worker comes next and serve on."""
        self.worker_ready = False
        self.worker_lost.clear()
        self._fail_all("the worker was lost; the request failed")
        self.stats_due.set()
        self._start(await self._handshake())
        pending, self._pending = self._pending, []
        for routing_id, msg in pending:
            self._add(routing_id, msg)
        log.warning("serving again: %d KV blocks", self.blocks.num_blocks if self.blocks else 0)
        self.stats_due.set()

    async def _handshake(self) -> WorkerReady:
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
                except asyncio.TimeoutError:  # an api that connected since must hear it too
                    self._send_api(EngineFailure(refused))
                    continue
            try:
                msg = worker_outbound_decoder.decode(raw)
            except msgspec.DecodeError:
                log.warning("dropped a malformed message from the worker (another build?)")
                continue
            if isinstance(msg, WorkerReady) and msg.incarnation in ("", incarnation):
                refused = self._refusal(msg)
                if refused is None:
                    return msg

    def _refusal(self, ready: WorkerReady) -> str | None:
        """Why a worker cannot be served (None: it can). One from another build never is: the
        api is told (its /health and every request say why) until a compatible one appears."""
        problem = check_peer("worker", ready.protocol)
        if problem is not None:
            log.error("%s", problem)
            self._send_api(EngineFailure(problem))
        return problem

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
            SchedulerConfig(
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                prefill_chunk_tokens=self.config.prefill_chunk_tokens,
                max_model_len=ready.max_model_len,
            ),
            self.blocks,
            SpecPolicy.from_config(self.config),
        )
        self.owners = {}

    def _fail_all(self, message: str) -> None:
        """Every request is lost (the worker stalled or restarted): tell each owning tokenizer
        (it drops their state) and the api (it answers 503 / an SSE error event)."""
        self._send_api(EngineFailure(message))  # first: the api answers before tokenizers do
        replies: dict[bytes, list[RequestTokens]] = collections.defaultdict(list)
        for req_id, owner in self.owners.items():
            replies[owner.routing_id].append(
                RequestTokens(req_id, b"", finish_reason="abort", error=message, error_status=503)
            )
        num_failed = len(self.owners)
        self.owners = {}
        self._send_items(replies)
        log.error("engine failure: %s (%d requests failed)", message, num_failed)

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
        try:
            if msg.action == "start":
                self.profiler.start(msg.num_steps, msg.record_shapes, msg.with_stack)
            elif msg.action == "stop":
                self.profiler.stop()
            else:
                log.warning("dropped a profile control with action %r", msg.action)
                return
        except Exception:  # a failed trace must not take the scheduler down
            log.exception("profile %s failed", msg.action)
        await self.plans.send(encoder.encode(msg))

    def _add(self, routing_id: bytes, msg: GenerateRequest) -> None:
        assert self.scheduler is not None and self.blocks is not None
        try:
            prompt = unpack_ids(msg.prompt_token_ids)
            max_tokens = check_request(
                prompt, msg.params, self.max_model_len, self.model_cfg.vocab_size
            )
            self.blocks.check_prompt(len(prompt))
            request = Request(
                msg.req_id,
                prompt,
                msg.params,
                max_tokens,
                self.model_cfg.eos_token_ids,
                arrival_time=arrival_monotonic(msg.arrival_time),
            )
            self.scheduler.add_request(request)
        except ValueError as e:
            log.info("rejected: %s", e, extra={"request_id": msg.req_id})
            reply = RequestTokens(msg.req_id, b"", finish_reason="abort", error=str(e))
            self._send_items({routing_id: [reply]})
            return
        self.owners[msg.req_id] = _Owner(routing_id)
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
        self._send_items(replies)
        self.stats_due.set()

    # -- steps ------------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        assert self.scheduler is not None
        inflight: collections.deque[StepPlan] = collections.deque()
        while True:
            if self.worker_lost.is_set():
                inflight.clear()
                await self._recover()
                continue
            if self._backlog:
                self._flush_backlog()
            if len(inflight) < self.depth and not self._backlog:
                t0, c0 = time.perf_counter(), time.thread_time()
                with span("schedule"):
                    plan = self.scheduler.schedule()
                t1, c1 = time.perf_counter(), time.thread_time()
                if plan.num_requests or plan.finished_req_ids:
                    plan.sent_at = time.time()
                    self.idle_gaps.plan_sent(plan.step_id)
                    await self.plans.send(encoder.encode(plan))
                    inflight.append(plan)
                    self.telemetry.observe("schedule", t1 - t0)
                    self.telemetry.observe("schedule_cpu", c1 - c0)
                    self.telemetry.observe("plan_encode", time.perf_counter() - t1)
                    if plan.num_requests and len(inflight) < self.depth:
                        continue  # plan the next step before waiting on this one
            if inflight:
                result = await self._next_result(inflight[0].step_id)
                if result is None:  # the worker restarted: its steps and KV are gone
                    inflight.clear()
                    continue
                t0 = time.perf_counter()
                plan = inflight.popleft()
                with span("update"):
                    self._publish(self.scheduler.update(plan, result))
                if self.kv_events is not None:  # once per step, after its blocks are computed
                    self.kv_events.publish(self.blocks.take_events())
                self._record_step(result, time.perf_counter() - t0)
                if self.profiler.active:
                    self.profiler.step()
                if not self.scheduler.has_unfinished():
                    self.stats_due.set()
                continue
            if self._backlog:  # a tokenizer is behind: no new step until it catches up
                await asyncio.sleep(BACKLOG_POLL_S)
                continue
            self.idle_gaps.engine_idle()
            self.wakeup.clear()
            await self._idle()

    async def _idle(self) -> None:
        """Wait for work; a worker that restarts meanwhile announces itself and is taken on
        now, not found out by the next request."""
        wake = asyncio.ensure_future(self.wakeup.wait())
        incoming = asyncio.ensure_future(self.results.poll())
        try:
            await asyncio.wait({wake, incoming}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            incoming.cancel()
        if await self.results.poll(0):  # nothing is in flight: no step result is due
            raw = await self.results.recv()
            try:
                msg = worker_outbound_decoder.decode(raw)
            except msgspec.DecodeError:
                log.warning("dropped a malformed message from the worker")
                return
            if isinstance(msg, WorkerReady) and msg.incarnation != self.incarnation:
                log.warning("the worker restarted: %d KV blocks", msg.num_blocks)
                self._restarted(msg)

    def _restarted(self, ready: WorkerReady) -> None:
        """A restarted worker announced itself: every request is lost. Serve it on its blocks,
        or, from another build, wait in the handshake for one that can be served."""
        self._fail_all("the worker restarted; the request was lost")
        if self._refusal(ready) is None:
            self._start(ready)
        else:
            self.worker_lost.set()
        self.stats_due.set()

    async def _next_result(self, step_id: int) -> StepResult | None:
        """The result of step_id; None when a restarted worker announced itself instead (every
        request failed, the core rebuilt on its blocks). Malformed or stale messages are dropped.
        Raises EngineStalled when the worker is silent for the step timeout."""
        while True:
            recv = asyncio.ensure_future(self.results.recv())
            lost = asyncio.ensure_future(self.worker_lost.wait())
            done, _ = await asyncio.wait(
                {recv, lost}, timeout=self.step_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            lost.cancel()
            if recv not in done:
                recv.cancel()
                if self.worker_lost.is_set():
                    return None  # the step loop recovers
                raise EngineStalled(f"the worker made no progress for {self.step_timeout_s:g} s")
            raw = recv.result()
            try:
                msg = worker_outbound_decoder.decode(raw)
            except msgspec.DecodeError:
                log.warning("dropped a malformed message from the worker")
                continue
            if isinstance(msg, WorkerReady) and msg.incarnation == self.incarnation:
                continue  # its answer to our hello, after it had announced itself unasked
            if isinstance(msg, WorkerReady):
                self._restarted(msg)
                return None
            if msg.step_id != step_id:
                log.warning("dropped a result for step %d (waiting for %d)", msg.step_id, step_id)
                continue
            return msg

    def _record_step(self, result: StepResult, update_s: float) -> None:
        t = self.telemetry
        t.num_steps += 1
        t.observe("update", update_s)
        t.observe("plan_ipc", max(0.0, result.plan_ipc_s))
        t.observe("result_ipc", max(0.0, time.time() - result.sent_at))
        t.observe("worker_prepare", result.prepare_s)
        t.observe("worker_forward", result.forward_s)
        t.observe("worker_forward_host", result.forward_host_s)
        t.observe("worker_sample", result.sample_s)
        t.observe("worker_idle", self.idle_gaps.gap(result.step_id, result.idle_s))
        if result.num_reqs:
            t.observe_batch(result.num_tokens, result.num_reqs)
        self.busy.add(result.prepare_s + result.forward_host_s + result.sample_s)

    def _publish(self, updates: list[RequestUpdate]) -> None:
        assert self.scheduler is not None
        owners = self.owners
        batches: dict[bytes, TokenBatch] = {}
        steady_tokens: dict[bytes, list[int]] = {}
        for update in updates:
            owner = owners.get(update.req_id)
            if owner is None:
                continue
            routing_id = owner.routing_id
            batch = batches.get(routing_id)
            if batch is None:
                batch = batches[routing_id] = TokenBatch([])
                steady_tokens[routing_id] = []
            request = update.request
            tokens = update.new_token_ids
            if (
                update.finish_reason is None
                and owner.announced
                and len(tokens) == 1
                and update.logprobs is None
                and not request.num_draft_tokens
            ):
                batch.steady_req_ids.append(update.req_id)
                steady_tokens[routing_id].append(tokens[0])
                continue
            reason = update.finish_reason.value if update.finish_reason else None
            item = RequestTokens(update.req_id, pack_ids(tokens), reason, update.logprobs)
            if not owner.announced:
                owner.announced = True
                item.num_prompt_tokens = request.prompt_len
                item.num_cached_tokens = max(request.num_cached_tokens, 0)
                if request.first_scheduled_time is not None:
                    item.queue_s = request.first_scheduled_time - request.arrival_time
            if request.num_draft_tokens:  # per request, for the token-ID request log
                item.num_draft_tokens = request.num_draft_tokens
                item.num_accepted_tokens = request.num_accepted_tokens
            if reason is not None:
                del owners[update.req_id]
            batch.items.append(item)
        for routing_id, tokens in steady_tokens.items():
            if tokens:
                batches[routing_id].steady_token_ids = pack_ids(tokens)
        self._send_batches(batches)

    def _send_items(self, items: dict[bytes, list[RequestTokens]]) -> None:
        self._send_batches({routing_id: TokenBatch(i) for routing_id, i in items.items()})

    def _send_batches(self, batches: dict[bytes, TokenBatch]) -> None:
        lost: list[bytes] = []
        for routing_id, batch in batches.items():
            if not batch.items and not batch.steady_req_ids:
                continue
            frames = [routing_id, encoder.encode(batch)]
            backlog = self._backlog.get(routing_id)
            if backlog is not None:  # behind batches its queue did not take: keep the order
                backlog.append(frames)
                continue
            try:
                self._send_now(frames)
            except zmq.ZMQError as e:
                if e.errno == zmq.EAGAIN:  # its queue is full: hold the batch, plan no step
                    self._backlog[routing_id] = collections.deque([frames])
                    self._backlog_moved[routing_id] = time.monotonic()
                else:  # gone (EHOSTUNREACH)
                    log.error("tokenizer %s cannot take its tokens (%s)", routing_id.decode(), e)
                    lost.append(routing_id)
        for routing_id in lost:
            self._fail_tokenizer(routing_id)

    def _flush_backlog(self) -> None:
        """Hand held batches on as their tokenizers' queues drain; fail a tokenizer that took
        none for TOKENIZER_STALL_S, or that went away."""
        now = time.monotonic()
        stuck: list[bytes] = []
        for routing_id, backlog in self._backlog.items():
            try:
                while backlog:
                    self._send_now(backlog[0])
                    backlog.popleft()
                    self._backlog_moved[routing_id] = now
            except zmq.ZMQError as e:
                if e.errno != zmq.EAGAIN:
                    log.error("tokenizer %s cannot take its tokens (%s)", routing_id.decode(), e)
                    stuck.append(routing_id)
                elif now - self._backlog_moved[routing_id] > TOKENIZER_STALL_S:
                    log.error("tokenizer %s took no tokens for %.0f s", routing_id.decode(),
                              TOKENIZER_STALL_S)  # fmt: skip
                    stuck.append(routing_id)
        for routing_id in [r for r, b in self._backlog.items() if not b] + stuck:
            del self._backlog[routing_id], self._backlog_moved[routing_id]
        for routing_id in stuck:
            self._fail_tokenizer(routing_id)

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
            self._send_api(EngineFailure(f"tokenizer {name} fell behind or went away", ids))
            self.stats_due.set()

    def _send_now(self, frames: list[bytes]) -> None:
        """Send on the router without waiting; raise zmq.ZMQError if the peer is unknown or full.

        Through the asyncio socket, never a sync shadow of it: ZMQ's read wakeup is edge
        triggered, and a send on a shadow can consume the edge that would have woken the pending
        recv, leaving requests unread in the socket until some other message arrives."""
        sent = self.router.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        if sent.done() and sent.exception() is not None:
            raise sent.exception()  # type: ignore[misc]

    def _send_api(self, msg: SchedulerStats | EngineFailure) -> None:
        try:
            self._send_now([API_ROUTING_ID, encoder.encode(msg)])
        except zmq.ZMQError as e:  # the api is not connected (yet): stats come again shortly
            log.debug("could not reach the api: %s", e)

    # -- stats ------------------------------------------------------------------------------------

    async def _stats_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stats_due.wait(), STATS_INTERVAL_S)
            self.stats_due.clear()
            self._send_api(self.stats())

    def stats(self) -> SchedulerStats:
        assert self.scheduler is not None and self.blocks is not None
        return SchedulerStats(
            worker_ready=self.worker_ready,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=self.blocks.num_free_blocks(),
            num_total_blocks=self.blocks.num_blocks,
            kv_usage=self.blocks.usage(),
            prefix_queries=self.scheduler.prefix_queries,
            prefix_hits=self.scheduler.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            max_model_len=self.max_model_len,
            model_name=self.model_name,
            telemetry=msgspec.structs.replace(self.telemetry, busy_fraction=self.busy.fraction()),
            spec=self.scheduler.spec.stats if self.scheduler.spec is not None else None,
            protocol=PROTOCOL,
        )
