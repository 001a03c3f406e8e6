"""The plan hand-off between two real processes: plans arrive in order and whole (one past the
size of any step's plan included), and a follower whose rank 0 vanishes without a word (as one
on another node sees it: no PR_SET_PDEATHSIG there) stops waiting instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

PLANS = [b"a", b"x" * 100_000, bytes(range(256))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out) -> None:  # noqa: ANN001
    import torch

    from stoker.services.worker.parallel.comm import Communicator
    from stoker.services.worker.parallel.plan_channel import PlanChannel

    comm = Communicator(rank, 2, torch.device("cpu"), "127.0.0.1", port)
    plans = PlanChannel(comm, "127.0.0.1", single_node=True)
    if rank == 0:
        for raw in PLANS:
            plans.send(raw)
        comm.barrier()  # rank 1 has them all
        os._exit(0)  # gone: no message, no clean close
    got = [plans.recv() for _ in PLANS]
    comm.barrier()
    out.put((got, plans.recv()))
    plans.close()


def test_plans_arrive_whole_and_the_follower_ends_when_rank_0_is_gone():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got, last = out.get(timeout=120)
        assert got == PLANS
        assert last is None  # rank 0's disconnect seen
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
