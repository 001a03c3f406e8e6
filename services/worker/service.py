"""The worker process: a blocking loop around ModelRunner. It does nothing but run steps.

It takes plans from the scheduler's PUSH socket in order and answers each with a StepResult.
With overlap scheduling the next plan is already queued when a step ends, so the device goes
straight on; the time spent waiting for a plan is reported as the idle gap.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from stoker.common.addresses import Addresses
from stoker.common.config import EngineConfig
from stoker.common.ipc import encoder, plan_decoder
from stoker.common.messages import ProfileControl, SchedulerHello, WorkerReady
from stoker.common.profiling import Profiler, control
from stoker.common.telemetry import plan_ipc_time
from stoker.common.wire_digest import PROTOCOL, check_peer
from stoker.services.worker.model_runner import ModelRunner
from stoker.services.worker.parallel.follower import follow
from stoker.services.worker.parallel.ranks import Ranks
from stoker.services.worker.warmup import warm_up

log = logging.getLogger("stoker.worker")


def run_worker(config: EngineConfig, addresses: Addresses, profile_dir: str | None = None) -> None:
    if config.tensor_parallel_size == 1:
        _serve(ModelRunner(config), addresses, profile_dir)
        return
    # Tensor parallel (docs/parallelism.md): this process is its node's local rank 0.
    ranks = Ranks(config, on_rank_exit=_rank_died)
    try:
        runner = ModelRunner(ranks.config, ranks.comm)
        if ranks.leader:
            _serve(runner, addresses, profile_dir, ranks)
        else:  # a node other than 0: no scheduler sockets; runs what rank 0 forwards
            warm_up(runner)
            follow(runner, ranks.plans)
    finally:
        ranks.stop()


def _serve(
    runner: ModelRunner, addresses: Addresses, profile_dir: str | None, ranks: Ranks | None = None
) -> None:
    profiler = Profiler(profile_dir, "worker")
    warm_up(runner)  # before ready: /health turns green only once the first request is fast
    ctx = zmq.Context()
    plans = ctx.socket(zmq.PULL)
    plans.connect(addresses.worker_plan)
    results = ctx.socket(zmq.PUSH)
    results.connect(addresses.worker_result)
    results.send(encoder.encode(_ready(runner, "")))
    log.info("worker ready: %d KV blocks of %d tokens", runner.num_blocks, runner.block_size)
    idle_since = time.perf_counter()
    free_at = time.time()  # wall clock, as the plan's sent_at: when a next plan could start
    try:
        while True:
            raw = plans.recv()
            started = time.perf_counter()
            try:
                plan = plan_decoder.decode(raw)
            except msgspec.DecodeError:
                log.exception("dropped a malformed plan")
                continue
            if ranks is not None:  # every rank runs every plan and control message
                ranks.send(raw)
            if isinstance(plan, SchedulerHello):  # a (re)started scheduler: start afresh
                if problem := check_peer("scheduler", plan.protocol):
                    log.error("%s", problem)  # the scheduler refuses this worker and says why
                runner.forget_requests()
                results.send(encoder.encode(_ready(runner, plan.incarnation)))
                log.info("answered scheduler %s", plan.incarnation[:8])
                continue
            if isinstance(plan, ProfileControl):
                control(profiler, plan)
                free_at = time.time()  # writing a trace is not the next plan's IPC
                continue
            plan_ipc_s = plan_ipc_time(plan.sent_at, free_at, time.time())
            try:
                result = runner.execute(plan)
            except Exception:  # e.g. a plan naming a request this worker never saw
                log.exception("step %d failed; dropped", plan.step_id)
                continue
            result.idle_s = started - idle_since
            result.plan_ipc_s = plan_ipc_s
            result.sent_at = time.time()
            results.send(encoder.encode(result))
            if profiler.active:
                profiler.step()  # at num_steps writes the trace: before free_at, as above
            idle_since, free_at = time.perf_counter(), time.time()
    finally:
        profiler.stop()  # a trace in progress is still written on SIGTERM
        plans.close(linger=0)
        results.close(linger=0)
        ctx.term()


def _ready(runner: ModelRunner, incarnation: str) -> WorkerReady:
    return WorkerReady(
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        vocab_size=runner.model_cfg.vocab_size,
        incarnation=incarnation,
        protocol=PROTOCOL,
    )


def _rank_died(pid: int, code: int) -> None:
    """A rank's collectives would hang or fail from now on: end the worker, a fault the launcher
    and the scheduler already handle."""
    os._exit(1)
