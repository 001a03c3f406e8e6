"""The scheduler's worker link on its own, against a stand-in worker: the handshake, refusing a
worker from another build, waiting for a step's result (dropping what is not it), a restart
seen mid-step or while idle, the step timeout, and a worker whose connection closes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from stoker.common.addresses import Addresses
from stoker.common.ipc import encoder, plan_decoder
from stoker.common.messages import EngineFailure, SchedulerHello, StepResult, WorkerReady
from stoker.common.wire_digest import PROTOCOL
from stoker.services.scheduler import worker_link
from stoker.services.scheduler.worker_link import EngineStalled, WorkerLink


class Worker:
    """The stand-in worker's sockets, and what the link told the api and the service."""

    def __init__(self, ctx: zmq.asyncio.Context, addresses: Addresses) -> None:
        self.plans, self.results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.plans.connect(addresses.worker_plan)
        self.results.connect(addresses.worker_result)
        self.told: list[EngineFailure] = []
        self.restarts: list[WorkerReady] = []

    async def send(self, *msgs: object) -> None:
        for msg in msgs:
            await self.results.send(msg if isinstance(msg, bytes) else encoder.encode(msg))


Check = Callable[[WorkerLink, Worker], Awaitable[None]]


def _run(tmp_path: Path, check: Check, step_timeout_s: float = 5.0) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            addresses = Addresses.in_run_dir(tmp_path / "run")
            worker = Worker(ctx, addresses)
            link = WorkerLink(
                ctx, addresses, step_timeout_s, worker.told.append, worker.restarts.append
            )
            await check(link, worker)
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())


def _ready(incarnation: str, num_blocks: int = 16, protocol: str = PROTOCOL) -> WorkerReady:
    return WorkerReady(num_blocks, 16, 64, 256, incarnation, protocol)


async def _hello(worker: Worker) -> SchedulerHello:
    hello = plan_decoder.decode(await asyncio.wait_for(worker.plans.recv(), 5))
    assert isinstance(hello, SchedulerHello) and hello.protocol == PROTOCOL
    return hello


def test_the_handshake_drops_what_does_not_answer_it(tmp_path) -> None:
    async def check(link: WorkerLink, worker: Worker) -> None:
        task = asyncio.ensure_future(link.handshake())
        hello = await _hello(worker)
        assert link.incarnation == hello.incarnation
        await worker.send(
            b"junk",  # another build's bytes: dropped
            StepResult(7, [], b""),  # a result for a previous scheduler's plan
            _ready("another-scheduler"),  # an answer to someone else's hello
            _ready(hello.incarnation, num_blocks=9),
        )
        ready = await asyncio.wait_for(task, 5)
        assert ready.num_blocks == 9 and not worker.told and not worker.restarts

    _run(tmp_path, check)


def test_a_worker_from_another_build_is_refused_until_one_of_this_build(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(worker_link, "REFUSAL_REPEAT_S", 0.05)

    async def check(link: WorkerLink, worker: Worker) -> None:
        task = asyncio.ensure_future(link.handshake())
        await _hello(worker)
        await worker.send(_ready("", protocol="0" * 16))  # started unasked, another build
        while len(worker.told) < 3:  # told at once, then again for an api that connects later
            assert not task.done()
            await asyncio.sleep(0.05)
        assert all("another stoker build" in f.message for f in worker.told)
        await worker.send(_ready("", num_blocks=5))
        assert (await asyncio.wait_for(task, 5)).num_blocks == 5

    _run(tmp_path, check)


def test_next_result_is_the_awaited_step_and_a_restart_ends_the_wait(tmp_path) -> None:
    async def check(link: WorkerLink, worker: Worker) -> None:
        link.incarnation = "ours"
        await worker.send(b"junk", _ready("ours"), StepResult(3, [], b""), StepResult(4, [], b""))
        result = await asyncio.wait_for(link.next_result(4), 5)
        assert result is not None and result.step_id == 4
        restarted = _ready("", num_blocks=7)
        await worker.send(restarted)
        assert await asyncio.wait_for(link.next_result(5), 5) is None
        assert worker.restarts == [restarted]

    _run(tmp_path, check)


def test_a_silent_worker_stalls_and_a_lost_one_ends_the_wait(tmp_path) -> None:
    async def check(link: WorkerLink, worker: Worker) -> None:
        with pytest.raises(EngineStalled):
            await link.next_result(1)
        link.lost.set()
        assert await asyncio.wait_for(link.next_result(1), 5) is None

    _run(tmp_path, check, step_timeout_s=0.05)


def test_idle_ends_on_wakeup_or_a_restart(tmp_path) -> None:
    async def check(link: WorkerLink, worker: Worker) -> None:
        link.incarnation = "ours"
        wakeup = asyncio.Event()
        wakeup.set()
        await asyncio.wait_for(link.idle(wakeup), 5)
        wakeup.clear()
        await worker.send(_ready("ours"))  # a late answer to our hello: not a restart
        await asyncio.wait_for(link.idle(wakeup), 5)
        restarted = _ready("")
        await worker.send(restarted)
        await asyncio.wait_for(link.idle(wakeup), 5)
        assert worker.restarts == [restarted]

    _run(tmp_path, check)


def test_a_closed_connection_sets_lost_and_wakes_the_loop(tmp_path) -> None:
    async def check(link: WorkerLink, worker: Worker) -> None:
        wakeup = asyncio.Event()
        watch = asyncio.ensure_future(link.watch(link.monitor(), wakeup))
        try:
            task = asyncio.ensure_future(link.handshake())
            await _hello(worker)  # connected
            worker.plans.close(linger=0)
            await asyncio.wait_for(link.lost.wait(), 5)
            assert wakeup.is_set()
            task.cancel()
        finally:
            watch.cancel()

    _run(tmp_path, check)
