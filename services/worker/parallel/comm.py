"""The ranks' communicator: torch.distributed, NCCL on CUDA and gloo on CPU, plus a gloo group
for start-up control on the host (block counts, barriers, the plan channel's endpoints). Plans
themselves travel over ZeroMQ (plan_channel.py), measured cheaper than a broadcast."""

from __future__ import annotations

import torch
import torch.distributed as dist

from stoker.services.worker.parallel.shard import Shard


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
        self.control = dist.new_group(backend="gloo")

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

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
