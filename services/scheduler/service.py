"""The scheduler process: one asyncio loop around the scheduler core. It only schedules.

Inbound (ROUTER): GenerateRequest and Abort from tokenizers, Abort from the api.
Outbound: StepPlans to the worker; per step, one TokenBatch per owning tokenizer; SchedulerStats
to the api. With overlap on, plan N+1 is sent before result N arrives (requests that will
sample in step N are assumed to continue), so the worker never waits on this loop.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

import msgspec
import uvloop
import zmq
import zmq.asyncio

from common.addresses import API_ROUTING_ID, Addresses, bind_address
from common.config import EngineConfig
from common.ipc import encoder, scheduler_inbound_decoder, worker_outbound_decoder
from common.messages import (
    Abort,
    GenerateRequest,
    RequestTokens,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenBatch,
    WorkerReady,
    pack_ids,
    unpack_ids,
)
from common.model_config import ModelConfig
from common.telemetry import BusyTracker, IdleGapAccounting, StepTelemetry
from common.validation import check_request
from services.engine_args import add_engine_args, engine_config_from_args
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from services.scheduler.speculation import SpecPolicy

log = logging.getLogger("stoker.scheduler")
STATS_INTERVAL_S = 0.25


class _Owner:
    __slots__ = ("routing_id", "announced")

    def __init__(self, routing_id: bytes) -> None:
        self.routing_id = routing_id
        self.announced = False  # the first RequestTokens carries prompt/cache/queue figures


class SchedulerService:
    def __init__(self, config: EngineConfig, addresses: Addresses, overlap: bool = True) -> None:
        self.config = config
        self.model_name = Path(config.model).name
        self.model_cfg = ModelConfig.from_folder(config.model)
        self.depth = 2 if overlap else 1  # plans in flight
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(bind_address(addresses.scheduler))
        self.plans = self.ctx.socket(zmq.PUSH)
        self.plans.bind(bind_address(addresses.worker_plan))
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(bind_address(addresses.worker_result))
        self.owners: dict[str, _Owner] = {}
        self.wakeup = asyncio.Event()
        self.stats_due = asyncio.Event()
        self.telemetry = StepTelemetry.empty()
        self.busy = BusyTracker()
        self.idle_gaps = IdleGapAccounting()
        self.scheduler: Scheduler | None = None
        self.blocks: BlockManager | None = None
        self.max_model_len = 0

    async def run(self) -> None:
        ready = worker_outbound_decoder.decode(await self.results.recv())
        assert isinstance(ready, WorkerReady), "the worker must announce itself first"
        self.max_model_len = ready.max_model_len
        self.blocks = BlockManager(
            ready.num_blocks, ready.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=ready.max_model_len,
            ),
            self.blocks,
            SpecPolicy.from_config(self.config),
        )
        log.info(
            "scheduler ready: %d blocks, max_model_len %d", ready.num_blocks, ready.max_model_len
        )
        await asyncio.gather(self._inbound_loop(), self._step_loop(), self._stats_loop())

    # -- inbound ----------------------------------------------------------------------------------

    async def _inbound_loop(self) -> None:
        while True:
            routing_id, raw = await self.router.recv_multipart()
            msg = scheduler_inbound_decoder.decode(raw)
            if isinstance(msg, GenerateRequest):
                self._add(routing_id, msg)
            elif isinstance(msg, Abort):
                self._abort(msg)
            self.wakeup.set()

    def _add(self, routing_id: bytes, msg: GenerateRequest) -> None:
        assert self.scheduler is not None and self.blocks is not None
        try:
            prompt = unpack_ids(msg.prompt_token_ids)
            max_tokens = check_request(
                prompt, msg.params, self.max_model_len, self.model_cfg.vocab_size
            )
            needed = -(-(len(prompt) + 1) // self.blocks.block_size)
            if needed > self.blocks.num_blocks:
                raise ValueError(
                    f"the prompt needs {needed} KV blocks; the cache has {self.blocks.num_blocks}"
                )
            request = Request(
                msg.req_id,
                prompt,
                msg.params,
                max_tokens,
                self.model_cfg.eos_token_ids,
            )
            self.scheduler.add_request(request)
        except ValueError as e:
            reply = RequestTokens(msg.req_id, b"", finish_reason="abort", error=str(e))
            self._send_batches({routing_id: [reply]})
            return
        self.owners[msg.req_id] = _Owner(routing_id)

    def _abort(self, msg: Abort) -> None:
        assert self.scheduler is not None
        replies: dict[bytes, list[RequestTokens]] = collections.defaultdict(list)
        for req_id in msg.req_ids:
            if self.scheduler.abort(req_id):
                owner = self.owners.pop(req_id, None)
                if owner is not None and msg.reason == "abort":
                    replies[owner.routing_id].append(
                        RequestTokens(req_id, b"", finish_reason="abort")
                    )
        self._send_batches(replies)
        self.stats_due.set()

    # -- steps ------------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        assert self.scheduler is not None
        inflight: collections.deque[StepPlan] = collections.deque()
        while True:
            if len(inflight) < self.depth:
                t0 = time.perf_counter()
                plan = self.scheduler.schedule()
                t1 = time.perf_counter()
                if plan.num_requests or plan.finished_req_ids:
                    plan.sent_at = time.time()
                    self.idle_gaps.plan_sent(plan.step_id)
                    await self.plans.send(encoder.encode(plan))
                    inflight.append(plan)
                    self.telemetry.observe("schedule", t1 - t0)
                    self.telemetry.observe("plan_encode", time.perf_counter() - t1)
                    if plan.num_requests and len(inflight) < self.depth:
                        continue  # plan the next step before waiting on this one
            if inflight:
                raw = await self.results.recv()
                result = worker_outbound_decoder.decode(raw)
                assert isinstance(result, StepResult)
                t0 = time.perf_counter()
                plan = inflight.popleft()
                self._publish(self.scheduler.update(plan, result))
                self._record_step(result, time.perf_counter() - t0)
                if not self.scheduler.has_unfinished():
                    self.stats_due.set()
                continue
            self.idle_gaps.engine_idle()
            self.wakeup.clear()
            await self.wakeup.wait()

    def _record_step(self, result: StepResult, update_s: float) -> None:
        t = self.telemetry
        t.num_steps += 1
        t.observe("update", update_s)
        t.observe("plan_ipc", max(0.0, result.plan_ipc_s))
        t.observe("result_ipc", max(0.0, time.time() - result.sent_at))
        t.observe("worker_prepare", result.prepare_s)
        t.observe("worker_forward", result.forward_s)
        t.observe("worker_sample", result.sample_s)
        t.observe("worker_idle", self.idle_gaps.gap(result.step_id, result.idle_s))
        self.busy.add(result.prepare_s + result.forward_s + result.sample_s)

    def _publish(self, updates: list[RequestUpdate]) -> None:
        assert self.scheduler is not None
        batches: dict[bytes, list[RequestTokens]] = collections.defaultdict(list)
        for update in updates:
            owner = self.owners.get(update.req_id)
            if owner is None:
                continue
            reason = update.finish_reason.value if update.finish_reason else None
            item = RequestTokens(
                update.req_id, pack_ids(update.new_token_ids), reason, update.logprobs
            )
            if not owner.announced:
                owner.announced = True
                request = update.request
                item.num_prompt_tokens = request.prompt_len
                item.num_cached_tokens = max(request.num_cached_tokens, 0)
                if request.first_scheduled_time is not None:
                    item.queue_s = request.first_scheduled_time - request.arrival_time
            if reason is not None:
                del self.owners[update.req_id]
            batches[owner.routing_id].append(item)
        self._send_batches(batches)

    def _send_batches(self, batches: dict[bytes, list[RequestTokens]]) -> None:
        for routing_id, items in batches.items():
            if items:
                self.router.send_multipart(
                    [routing_id, encoder.encode(TokenBatch(items))], copy=False
                )

    # -- stats ------------------------------------------------------------------------------------

    async def _stats_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stats_due.wait(), STATS_INTERVAL_S)
            self.stats_due.clear()
            await self.router.send_multipart([API_ROUTING_ID, encoder.encode(self.stats())])

    def stats(self) -> SchedulerStats:
        assert self.scheduler is not None and self.blocks is not None
        return SchedulerStats(
            worker_ready=True,
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
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stoker scheduler", description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--no-overlap", action="store_true", help="one step in flight at a time")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("STOKER_LOG_LEVEL", "INFO"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    service = SchedulerService(
        engine_config_from_args(args), Addresses.from_env(), overlap=not args.no_overlap
    )
    uvloop.run(service.run())


if __name__ == "__main__":
    main()
