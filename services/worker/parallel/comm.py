"""The ranks' communicator: torch.distributed, NCCL on CUDA and gloo on CPU, plus a gloo group
for control (plans, block counts) whose timeout outlasts any idle spell.

Plans travel as bytes in one broadcast of a fixed buffer (length header, then the payload); only
a plan larger than the buffer needs a second broadcast for its tail. The compute group keeps
torch's default timeout: its collectives only ever run while every rank is inside a step.
"""

from __future__ import annotations

import datetime
import struct

import numpy as np
import torch
import torch.distributed as dist

from services.worker.parallel.shard import Shard

PLAN_BUFFER_BYTES = 16 * 1024  # a decode plan at batch 256 is about 10 KiB
_HEADER = struct.Struct("<q")
_STOP = -1
# A worker may idle for days between requests; a follower waits for the next plan all along.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class Communicator:
    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        master_addr: str,
        master_port: int,
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.shard = Shard(rank, world_size)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            device_id=device if cuda else None,
        )
        self.nccl = cuda
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self._buf = torch.zeros(PLAN_BUFFER_BYTES, dtype=torch.uint8)
        self._view = self._buf.numpy()

    # -- compute (model) collectives ------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. Every rank gets the same bits (ring reduce, then share)."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n] per rank -> [T, world * n], rank 0's columns first."""
        x = x.contiguous()
        if self.nccl:
            out = x.new_empty((self.world_size, *x.shape))
            dist.all_gather_into_tensor(out, x)
            return out.movedim(0, -2).reshape(*x.shape[:-1], -1)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    # -- control ---------------------------------------------------------------------------------

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def send_bytes(self, data: bytes) -> None:
        """Rank 0: hand `data` (a plan) to every other rank."""
        self._broadcast(data)

    def send_stop(self) -> None:
        self._broadcast(None)

    def recv_bytes(self) -> bytes | None:
        """Other ranks: the next plan from rank 0, or None when it says stop."""
        return self._broadcast(None)

    def _broadcast(self, data: bytes | None) -> bytes | None:
        view, room = self._view, PLAN_BUFFER_BYTES - _HEADER.size
        if self.rank == 0:
            n = _STOP if data is None else len(data)
            _HEADER.pack_into(view, 0, n)
            if data:
                head = min(n, room)
                view[_HEADER.size : _HEADER.size + head] = np.frombuffer(data, np.uint8, head)
        dist.broadcast(self._buf, src=0, group=self.control)
        (n,) = _HEADER.unpack_from(view, 0)
        if n == _STOP:
            return None
        if n <= room:
            return data if self.rank == 0 else view[_HEADER.size : _HEADER.size + n].tobytes()
        tail = torch.empty(n - room, dtype=torch.uint8)
        if self.rank == 0:
            assert data is not None
            tail.numpy()[:] = np.frombuffer(data, np.uint8, offset=room)
        dist.broadcast(tail, src=0, group=self.control)
        if self.rank == 0:
            return data
        return view[_HEADER.size :].tobytes() + tail.numpy().tobytes()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
