"""Rank 0 hands each plan to the other ranks over ZeroMQ: one PUSH socket per rank, bound by
rank 0 on a free port, the endpoints shared once over the control group at start-up.

Measured against a torch.distributed broadcast of the same bytes (gloo) between two processes
on this project's 2-core box, one way: about 70 us against 400 us (benchmarks/tensor_parallel.py,
docs/parallelism.md). A PUSH socket never drops: with no peer yet connected, a send waits.
A follower also watches its socket for a disconnect, so one on another node ends when rank 0
goes away instead of waiting for ever (local ranks are killed with their parent anyway).
"""

from __future__ import annotations

import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from stoker.services.worker.parallel.comm import Communicator


class PlanChannel:
    def __init__(self, comm: Communicator, master_addr: str, single_node: bool) -> None:
        self.ctx = zmq.Context()
        self.rank = comm.rank
        endpoints: list[str | None] = [None]
        self.pushes: list[zmq.Socket] = []
        if comm.rank == 0:
            # One node: loopback only. Several: every interface (unauthenticated, like the
            # rendezvous port: keep it on a private network).
            host = "127.0.0.1" if single_node else "*"
            names = []
            for _ in range(comm.world_size - 1):
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, 0)
                port = sock.bind_to_random_port(f"tcp://{host}")
                names.append(f"tcp://{master_addr}:{port}")
                self.pushes.append(sock)
            endpoints = [",".join(names)]
        dist.broadcast_object_list(endpoints, src=0, group=comm.control)
        if comm.rank != 0:
            assert endpoints[0] is not None
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.RCVHWM, 0)
            self.pull.setsockopt(zmq.LINGER, 0)
            self.monitor = self.pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.pull.connect(endpoints[0].split(",")[comm.rank - 1])
            self.poller = zmq.Poller()
            self.poller.register(self.pull, zmq.POLLIN)
            self.poller.register(self.monitor, zmq.POLLIN)

    def send(self, raw: bytes) -> None:
        """Rank 0: the plan (or control message) it just received, to every other rank."""
        for sock in self.pushes:
            sock.send(raw, copy=False)

    def recv(self) -> bytes | None:
        """Other ranks: the next plan; None once rank 0 goes away."""
        while True:
            ready = dict(self.poller.poll())
            if self.pull in ready:
                return self.pull.recv()
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                return None

    def close(self) -> None:
        if self.rank != 0:
            self.pull.disable_monitor()
            self.monitor.close(0)
            self.pull.close(0)
        for sock in self.pushes:
            sock.close(0)
        self.ctx.term()
