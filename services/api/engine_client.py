"""The api's side of the sockets: send requests to tokenizers, route their deltas to HTTP handlers.

One background task reads `api_inbound` (text from tokenizers, heartbeats) and puts each delta on
the queue of the handler that owns the request; another reads SchedulerStats from the DEALER
socket that also carries aborts to the scheduler. Per-request latency metrics are observed here,
where every delta passes, so they do not depend on how (or whether) a client reads its stream.

(Past 400 lines on purpose: the tokenizer registry, the request tracks, the dispatch of deltas
and the health verdict share one state, the requests in flight, that would otherwise cross
modules on every delta.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from stoker.common.addresses import API_ROUTING_ID, Addresses, bind_address
from stoker.common.ipc import api_from_scheduler_decoder, api_inbound_decoder, encoder
from stoker.common.messages import (
    Abort,
    EngineFailure,
    ProfileControl,
    SchedulerStats,
    TextBatch,
    TextDelta,
    TokenizeRequest,
    TokenizerHeartbeat,
    num_ids,
)
from stoker.common.wire_digest import check_peer
from stoker.services.api.delta_queue import DeltaQueue
from stoker.services.api.metrics import LATENCY_BUCKETS, EngineSnapshot, Metrics
from stoker.services.api.openai_schema import ApiError
from stoker.services.api.request_log import ChoiceLog, RequestLog

log = logging.getLogger("stoker.api")
STALE_S = 2.0  # a tokenizer or scheduler silent for longer is unhealthy
# A tokenizer silent this long is gone: its in-flight requests fail with a 503 and it is
# forgotten (a restarted tokenizer heartbeats under a new id). Generous, because a busy box can
# starve a niced tokenizer for a while without it being dead.
LOST_S = float(os.environ.get("STOKER_TOKENIZER_LOST_S", "10"))
TOMBSTONE_S = 60.0
# A request that finds no live tokenizer waits this long for one to heartbeat before its 503: at
# start-up the API answers (/v1/models) seconds before the tokenizers have registered, and a
# restarted tokenizer takes as long to come back.
TOKENIZER_WAIT_S = float(os.environ.get("STOKER_TOKENIZER_WAIT_S", "30"))


@dataclasses.dataclass
class _Track:
    """One sub-request in flight: where its deltas go, and timings for metrics."""

    queue: DeltaQueue
    arrival: float
    first: float | None = None
    last: float = 0.0
    tokenizer: str = ""  # the tokenizer it was sent to, and that process's pid then
    tokenizer_pid: int = 0
    waiting: bool = True  # no token yet: counts against --max-queued-requests
    log: ChoiceLog | None = None  # --log-requests


@dataclasses.dataclass
class _Tokenizer:
    pid: int
    requests_served: int
    last_seen: float
    slot: str = ""  # what a restart keeps (--id or the host); the id is per incarnation
    refused: str | None = None  # why it gets no requests: it runs another stoker build


class EngineClient:
    def __init__(
        self,
        addresses: Addresses,
        num_tokenizers: int,
        max_queued_requests: int = 1024,
        engine_lost_s: float = 30.0,
        request_log: RequestLog | None = None,
    ) -> None:
        self.addresses = addresses
        self.num_tokenizers = num_tokenizers
        self.max_queued_requests = max_queued_requests
        # Scheduler stats silent this long: the scheduler is dead or wedged, so every request in
        # flight fails (they could only hang) until it is heard from again.
        self.engine_lost_s = engine_lost_s
        self.engine_error: str | None = None  # set while the engine is known to be down
        self.num_waiting = 0  # sub-requests with no token yet, in O(1)
        self.metrics = Metrics(self.snapshot)
        self.request_log = request_log
        if request_log is not None:
            self.metrics.registry.register(request_log.collector())
        self.stats: SchedulerStats | None = None
        self.stats_time = 0.0
        self.tokenizers: dict[str, _Tokenizer] = {}
        self._next_tokenizer = 0  # round robin over the live ones
        self._tracks: dict[str, _Track] = {}
        # Aborted ids whose request may still reach the scheduler after the abort did (the
        # tokenizer had not forwarded it yet): any later delta for them re-sends the abort.
        self._aborted: dict[str, float] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._inbound = self._ctx.socket(zmq.PULL)
        self._inbound.bind(bind_address(self.addresses.api_inbound))
        # ROUTER: each request goes to a chosen, live tokenizer (by its routing id), so the
        # requests of a tokenizer that dies can be failed instead of hanging.
        self._requests = self._ctx.socket(zmq.ROUTER)
        self._requests.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not a drop
        self._requests.bind(bind_address(self.addresses.tokenizer_requests))
        self._scheduler = self._ctx.socket(zmq.DEALER)
        self._scheduler.setsockopt(zmq.ROUTING_ID, API_ROUTING_ID)
        self._scheduler.connect(self.addresses.scheduler)
        self._tasks = [
            asyncio.create_task(self._inbound_loop()),
            asyncio.create_task(self._stats_loop()),
            asyncio.create_task(self._lost_tokenizer_loop()),
            asyncio.create_task(self._engine_watch_loop()),
            asyncio.create_task(
                self._scheduler_watch_loop(
                    self._scheduler.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                )
            ),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._ctx.destroy(linger=0)
        if self.request_log is not None:
            await asyncio.to_thread(self.request_log.close)

    # -- requests -------------------------------------------------------------------------------

    def admission_error(self, num_requests: int) -> ApiError | None:
        """Why a call with this many sub-requests cannot be taken now, or None. Overload and a
        down engine are 503s with Retry-After: the client should come back, not give up."""
        if self.engine_error is not None:
            message = f"the engine is unavailable: {self.engine_error}"
        elif self.num_waiting + num_requests > self.max_queued_requests:
            message = (
                f"the server is overloaded: {self.num_waiting} requests are already waiting "
                f"(--max-queued-requests {self.max_queued_requests}); retry later"
            )
        else:
            return None
        return ApiError(message, status=503, type="server_error", code="overloaded")

    async def submit(self, requests: list[TokenizeRequest]) -> DeltaQueue:
        """Send sub-requests to the tokenizers; all their deltas arrive on the returned queue."""
        error = self.admission_error(len(requests))
        if error is not None:
            raise error
        queue = DeltaQueue()
        now = time.monotonic()
        tracks = [_Track(queue, now) for _ in requests]
        if self.request_log is not None:
            for r, track in zip(requests, tracks):
                track.log = self.request_log.start(r)
        for r, track in zip(requests, tracks):  # registered first: a delta may beat the send
            self._tracks[r.req_id] = track
        self.num_waiting += len(tracks)
        try:
            for r, track in zip(requests, tracks):
                await self._send_to_tokenizer(encoder.encode(r), track)
        except BaseException:  # an ApiError, or cancelled while waiting for a tokenizer
            self.release([r.req_id for r in requests], count=False)
            raise
        return queue

    async def _live_tokenizers(self) -> list[str]:
        """The tokenizers heartbeating now, waiting up to TOKENIZER_WAIT_S for a first one."""
        deadline = time.monotonic() + TOKENIZER_WAIT_S
        while True:
            now = time.monotonic()
            alive = sorted(
                t
                for t, s in self.tokenizers.items()
                if now - s.last_seen < STALE_S and s.refused is None
            )
            if alive or now >= deadline or self.engine_error is not None:
                return alive
            await asyncio.sleep(0.05)

    async def _send_to_tokenizer(self, payload: bytes, track: _Track) -> None:
        """To the next live tokenizer, round robin; 503 when none takes it."""
        alive = await self._live_tokenizers()
        for i in range(len(alive)):
            name = alive[(self._next_tokenizer + i) % len(alive)]
            track.tokenizer, track.tokenizer_pid = name, self.tokenizers[name].pid
            try:
                await self._requests.send_multipart([name.encode(), payload])
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                continue  # it heartbeats but its request socket is gone or not yet connected
            self._next_tokenizer = (self._next_tokenizer + i + 1) % len(alive)
            return
        message = "no tokenizer process is available"
        if refused := self._refused_tokenizer():
            message = f"{message}: {refused}"
        raise ApiError(message, status=503, type="server_error")

    def _refused_tokenizer(self) -> str | None:
        """Why a heartbeating tokenizer gets no requests, if one does not."""
        now = time.monotonic()
        for t in self.tokenizers.values():
            if t.refused is not None and now - t.last_seen < STALE_S:
                return t.refused
        return None

    def _untrack(self, req_id: str) -> _Track | None:
        track = self._tracks.pop(req_id, None)
        if track is not None and track.waiting:
            self.num_waiting -= 1
        if track is not None and track.log is not None:
            self._log_ended(track, track.log)
        return track

    def _log_ended(self, track: _Track, c: ChoiceLog) -> None:
        """The choice ended (finished, failed, or released while running: an abort)."""
        assert self.request_log is not None
        c.tokenizer_id = track.tokenizer
        c.e2e_s = time.monotonic() - track.arrival  # called as the last delta is dispatched
        if track.first is not None:
            c.ttft_s = track.first - track.arrival
        self.request_log.finish(c)

    def release(self, req_ids: list[str], count: bool = True) -> None:
        """The handler is done with these ids: abort the ones still running (the client went
        away), counted as finished with reason abort unless count is False. Never blocks, so
        it is safe in `finally` of a cancelled handler."""
        live = [i for i in req_ids if self._untrack(i) is not None]
        if live:
            log.info("aborted: the client went away", extra={"request_ids": live})
            if count:
                self.metrics.request_success.labels("abort").inc(len(live))
            now = time.monotonic()
            self._aborted.update(dict.fromkeys(live, now))
            self._send_abort(live)

    def fail(self, req_ids: list[str] | None, message: str, status: int = 503) -> list[str]:
        """End these requests (None: every one in flight) with an error delta and abort them
        upstream. Their handlers answer the status (or an SSE error event, then [DONE])."""
        ids = list(self._tracks) if req_ids is None else [i for i in req_ids if i in self._tracks]
        for req_id in ids:
            delta = TextDelta(
                req_id, "", b"", finish_reason="abort", error=message, error_status=status
            )
            track = self._tracks[req_id]
            track.queue.put_nowait(delta)
            if track.log is not None:
                track.log.add(delta)
        if ids:
            log.warning("failed: %s", message, extra={"request_ids": ids})
            self.metrics.request_success.labels("abort").inc(len(ids))
            # As a client that went away: the scheduler may hold them, or get them later from a
            # tokenizer that was only stalled; release aborts now and tombstones late deltas.
            self.release(ids, count=False)  # counted just above
        return ids

    def engine_lost(self, message: str) -> None:
        """The worker or scheduler is gone: fail everything in flight, refuse new work and
        report unhealthy until the scheduler reports a ready worker again."""
        if self.engine_error is None:
            log.error("engine lost: %s", message)
        self.engine_error = message
        failed = self.fail(None, f"the engine failed: {message}")
        if failed:
            log.error("failed %d requests in flight", len(failed))

    def _send_abort(self, req_ids: list[str]) -> None:
        # With NOBLOCK the async socket sends now or queues behind earlier sends; a failure
        # lands on the future (logged), and a later delta for the id retries the abort.
        fut = self._scheduler.send(encoder.encode(Abort(req_ids)), zmq.NOBLOCK)
        fut.add_done_callback(_log_send_error)

    def send_control(self, msg: ProfileControl) -> None:
        """To the scheduler, which applies it and passes it on to the worker."""
        fut = self._scheduler.send(encoder.encode(msg), zmq.NOBLOCK)
        fut.add_done_callback(_log_send_error)

    # -- background loops -----------------------------------------------------------------------

    async def _inbound_loop(self) -> None:
        while True:
            raw = await self._inbound.recv()
            try:
                msg = api_inbound_decoder.decode(raw)
                if isinstance(msg, TextBatch):
                    self._dispatch(msg)
                    # Text from a tokenizer is as good as a heartbeat from it.
                    tokenizer = self.tokenizers.get(msg.tokenizer_id)
                    if tokenizer is not None:
                        tokenizer.last_seen = time.monotonic()
                elif isinstance(msg, TokenizerHeartbeat):
                    self._on_heartbeat(msg)
                elif isinstance(msg, SchedulerStats):
                    self._on_stats(msg)
            except Exception:  # one bad message must not stop all responses
                log.exception("dropped a message on api_inbound (%d bytes)", len(raw))

    def _on_heartbeat(self, msg: TokenizerHeartbeat) -> None:
        now = time.monotonic()
        if msg.slot:
            # Another id in this slot with the same pid (pid 1 in a restarted container), or
            # one gone quiet, is this process's predecessor: its requests died with it, so fail
            # them now rather than after LOST_S. Two live processes on one host (same slot,
            # different pids) are both kept.
            replaced = False
            for name, t in self.tokenizers.items():
                same_slot = name != msg.tokenizer_id and t.slot == msg.slot
                if same_slot and (t.pid == msg.pid or now - t.last_seen > STALE_S):
                    t.last_seen = -float("inf")
                    replaced = True
            if replaced:
                self.fail_lost_tokenizers(now)
        refused = check_peer(f"tokenizer {msg.slot or msg.tokenizer_id}", msg.protocol)
        known = self.tokenizers.get(msg.tokenizer_id)
        if refused is not None and (known is None or known.refused is None):
            log.error("%s", refused)  # once per tokenizer process: it gets no requests
        self.tokenizers[msg.tokenizer_id] = _Tokenizer(
            msg.pid, msg.requests_served, now, msg.slot, refused
        )

    async def _lost_tokenizer_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.fail_lost_tokenizers(time.monotonic())

    def fail_lost_tokenizers(self, now: float) -> list[str]:
        """Fail the requests of tokenizers silent for LOST_S, or restarted since they took the
        request (a new pid: the old process's state is gone), and forget the silent ones.
        Returns the failed request ids."""
        lost = {t for t, s in self.tokenizers.items() if now - s.last_seen > LOST_S}
        by_tokenizer: dict[str, list[str]] = {}
        for req_id, track in self._tracks.items():
            current = self.tokenizers.get(track.tokenizer)
            restarted = current is not None and current.pid != track.tokenizer_pid
            if track.tokenizer in lost or restarted:
                by_tokenizer.setdefault(track.tokenizer, []).append(req_id)
        failed = []
        for name, ids in by_tokenizer.items():
            message = f"tokenizer {name} stopped responding; the request was lost"
            failed += self.fail(ids, message)
        for name in lost:
            log.warning("tokenizer %s silent or replaced: forgotten", name)
            del self.tokenizers[name]
        if failed:
            log.warning("failed %d requests of lost tokenizers", len(failed))
        return failed

    async def _scheduler_watch_loop(self, monitor: zmq.asyncio.Socket) -> None:
        """A scheduler that dies closes its connection: everything in flight is lost now."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self.stats is not None:
                self.engine_lost("the scheduler disconnected")

    async def _engine_watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.stats is not None and self.engine_error is None:
                silent = time.monotonic() - self.stats_time
                if silent > self.engine_lost_s:
                    self.engine_lost(f"the scheduler has been silent for {silent:.0f} s")

    async def _stats_loop(self) -> None:
        while True:
            frames = await self._scheduler.recv_multipart()
            try:
                msg = api_from_scheduler_decoder.decode(frames[-1])
            except msgspec.DecodeError:
                log.exception("dropped a malformed message from the scheduler")
                continue
            if isinstance(msg, EngineFailure):
                if msg.req_ids is None:
                    self.engine_lost(msg.message)
                else:
                    self.fail(msg.req_ids, msg.message)
            else:
                self._on_stats(msg)

    def _on_stats(self, stats: SchedulerStats) -> None:
        if refused := check_peer("scheduler", stats.protocol):
            self.engine_lost(refused)  # until a scheduler of this build reports
            return
        self.stats, self.stats_time = stats, time.monotonic()
        if stats.worker_ready and self.engine_error is not None:
            log.warning("the engine is back: %d KV blocks", stats.num_total_blocks)
            self.engine_error = None
        if self._aborted:
            cutoff = self.stats_time - TOMBSTONE_S
            self._aborted = {k: t for k, t in self._aborted.items() if t > cutoff}

    def _dispatch(self, batch: TextBatch) -> None:
        now = time.monotonic()
        late_aborts: list[str] = []
        if batch.items:
            self._dispatch_items(batch.items, now, late_aborts)
        if batch.steady_req_ids:
            self._dispatch_steady(batch, now, late_aborts)
        if late_aborts:
            self._send_abort(late_aborts)

    def _dispatch_steady(self, batch: TextBatch, now: float, late_aborts: list[str]) -> None:
        """The batch's steady rows: one token each for a request that goes on (what
        _dispatch_items does for such a delta, with the checks that cannot fire left out)."""
        tracks, aborted = self._tracks, self._aborted
        buf = batch.steady_token_ids
        others: list[TextDelta] = []
        # Rows whose last tokens came in one batch share their gap: one ITL observation each.
        lasts: dict[float, int] = {}
        offset = 0
        for req_id, text in zip(batch.steady_req_ids, batch.steady_texts):
            offset += 4
            track = tracks.get(req_id)
            if track is None:
                if req_id in aborted:
                    late_aborts.append(req_id)
                continue
            d = TextDelta(req_id, text, buf[offset - 4 : offset])
            if track.first is None:  # not from a stoker scheduler (it announces first tokens)
                others.append(d)
                continue
            track.queue.put_nowait(d)
            if track.log is not None:
                track.log.add(d)
            last = track.last
            lasts[last] = lasts.get(last, 0) + 1
            track.last = now
        itl = self.metrics.itl
        for last, n in lasts.items():
            itl.observe(now - last, LATENCY_BUCKETS, n)
        self.metrics.generation_tokens += sum(lasts.values())
        if others:
            self._dispatch_items(others, now, late_aborts)

    def _dispatch_items(self, items: list[TextDelta], now: float, late_aborts: list[str]) -> None:
        m = self.metrics
        for d in items:
            track = self._tracks.get(d.req_id)
            if track is None:
                if d.req_id in self._aborted:
                    if d.finish_reason is None and d.error is None:
                        late_aborts.append(d.req_id)
                    else:
                        del self._aborted[d.req_id]
                continue
            track.queue.put_nowait(d)
            if track.log is not None:
                track.log.add(d)
            if d.error is not None:
                self._untrack(d.req_id)
                continue
            num_tokens = num_ids(d.token_ids)
            if track.waiting and (num_tokens or d.finish_reason is not None):
                track.waiting = False
                self.num_waiting -= 1
            if num_tokens:
                if track.first is None:
                    track.first = now
                    m.ttft.observe(now - track.arrival)
                    m.queue_time.observe(d.queue_s)
                    if d.grammar_compile_s or d.grammar_cache_hit:
                        m.grammar_compiles.labels("hit" if d.grammar_cache_hit else "miss").inc()
                        if not d.grammar_cache_hit:
                            m.grammar_compile.observe(d.grammar_compile_s)
                    m.prompt_tokens.inc(d.num_prompt_tokens)
                else:
                    # Tokens that arrive together share the gap since the last ones.
                    m.itl.observe((now - track.last) / num_tokens, LATENCY_BUCKETS, num_tokens)
                track.last = now
                m.generation_tokens += num_tokens
            if d.finish_reason is not None:
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "finished (%s) in %.3f s",
                        d.finish_reason,
                        now - track.arrival,
                        extra={"request_id": d.req_id},
                    )
                m.e2e.observe(now - track.arrival)
                if d.grammar_mask_s:
                    m.grammar_mask.observe(d.grammar_mask_s)
                if d.num_forced_tokens:
                    m.grammar_forced_tokens.inc(d.num_forced_tokens)
                m.request_success.labels(d.finish_reason).inc()
                self._untrack(d.req_id)

    # -- state ----------------------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self._tracks)

    def health(self) -> tuple[bool, str]:
        now = time.monotonic()
        if self.engine_error is not None:
            return False, f"engine down: {self.engine_error}"
        alive = [t for t, s in self.tokenizers.items() if now - s.last_seen < STALE_S]
        if len(alive) < len(self.tokenizers):
            stale = sorted(set(self.tokenizers) - set(alive))
            return False, f"tokenizers not heartbeating: {', '.join(stale)}"
        usable = [t for t in alive if self.tokenizers[t].refused is None]
        if len(usable) < self.num_tokenizers:
            # One from another build is never sent requests: say so rather than count it.
            refused = self._refused_tokenizer()
            return False, refused or f"{len(usable)} of {self.num_tokenizers} tokenizers up"
        if self.stats is None or now - self.stats_time > STALE_S:
            return False, "no recent scheduler stats"
        if not self.stats.worker_ready:
            return False, "worker not ready"
        return True, "ok"

    def snapshot(self) -> EngineSnapshot:
        # Labelled by slot: a restarted tokenizer keeps its series (its count starts again).
        served = {t.slot or k: t.requests_served for k, t in self.tokenizers.items()}
        return EngineSnapshot(self.stats, served)

    def state(self) -> dict:
        now = time.monotonic()
        return {
            "scheduler": msgspec.structs.asdict(self.stats) if self.stats else None,
            "scheduler_age_s": now - self.stats_time if self.stats else None,
            "tokenizers": {  # by slot; "id" is the current incarnation's
                t.slot or k: {
                    "id": k,
                    "pid": t.pid,
                    "requests": t.requests_served,
                    "age_s": now - t.last_seen,
                    "refused": t.refused,
                }
                for k, t in self.tokenizers.items()
            },
            "api_inflight": len(self._tracks),
            "api_waiting": self.num_waiting,
            "engine_error": self.engine_error,
            "request_log": None
            if self.request_log is None
            else {
                "written": self.request_log.writer.written,
                "dropped": self.request_log.writer.dropped,
                "failed": self.request_log.writer.failed,
            },
        }


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("could not send to the scheduler: %s", fut.exception())
