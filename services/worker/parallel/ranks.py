"""Starting a node's ranks, torchrun style: the calling process (the worker service, or the
offline LLM) is this node's local rank 0 and spawns local ranks 1..n-1 as child processes
(`python -m stoker.services.worker.parallel.follower`). Global rank = node_rank * n + local rank;
node 0's local rank 0 is rank 0, the one that talks to the scheduler.

No orphans: a child gets SIGKILL from the kernel when its parent dies (PR_SET_PDEATHSIG, so a
SIGKILLed worker takes its ranks along), `stop` terminates them, and a rank that dies on its own
is reported by a watcher thread (the worker then exits, as it would on any fatal fault).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import torch

from stoker.common.config import EngineConfig
from stoker.common.config_args import to_json
from stoker.common.model_config import ModelConfig
from stoker.services.worker.loader import check_model_folder
from stoker.services.worker.parallel.comm import Communicator
from stoker.services.worker.parallel.plan_channel import PlanChannel
from stoker.services.worker.parallel.shard import check_divisible

log = logging.getLogger("stoker.worker")
TORCHRUN_PORT = 29500
_PR_SET_PDEATHSIG = 1
ENV_CONFIG, ENV_RANK, ENV_LOCAL_RANK, ENV_PARENT, ENV_WARM_UP = (
    "STOKER_TP_CONFIG",
    "STOKER_TP_RANK",
    "STOKER_TP_LOCAL_RANK",
    "STOKER_TP_PARENT",
    "STOKER_TP_WARM_UP",
)


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """A rank's own settings: its own GPU (cuda:local_rank), or its share of the CPU cores."""
    per_node = config.tensor_parallel_size // config.nnodes
    if torch.device(config.device).type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{local_rank}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    return config


def connect(config: EngineConfig, rank: int) -> Communicator:
    assert config.master_port is not None
    return Communicator(
        rank,
        config.tensor_parallel_size,
        torch.device(config.device),
        config.master_addr,
        config.master_port,
    )


class Ranks:
    """This node's local ranks, as seen from local rank 0."""

    def __init__(
        self,
        config: EngineConfig,
        on_rank_exit: Callable[[int, int], None] | None = None,
        warm_up: bool = True,
    ) -> None:
        """warm_up: whether rank 0 runs services/worker/warmup.py (the others then do too, as
        its steps are collectives)."""
        tp, nodes = config.tensor_parallel_size, config.nnodes
        # Refused here, before any rank starts: a rank that failed this alone would leave the
        # others waiting at the rendezvous.
        check_divisible(ModelConfig.from_folder(check_model_folder(config.model)), tp)
        if config.master_port is None:
            port = _free_port() if nodes == 1 else TORCHRUN_PORT
            config = dataclasses.replace(config, master_port=port)
        per_node = tp // nodes
        first = config.node_rank * per_node
        self._stopping = False
        self.procs = [self._spawn(config, first + i, i, warm_up) for i in range(1, per_node)]
        for proc in self.procs:
            threading.Thread(
                target=self._watch, args=(proc, on_rank_exit), daemon=True, name="tp-watch"
            ).start()
        self.config = rank_config(config, 0)
        try:
            self.comm = connect(self.config, first)
            self.plans = PlanChannel(self.comm, config.master_addr, nodes == 1)
        except BaseException:
            self.stop()
            raise

    @property
    def leader(self) -> bool:
        """Rank 0: the one process that receives plans and answers them."""
        return self.comm.rank == 0

    def send(self, raw: bytes) -> None:
        """Hand the plan (or control message) rank 0 just received to every other rank."""
        self.plans.send(raw)

    def stop(self) -> None:
        self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()  # a follower keeps SIGTERM's default action: it just ends
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if hasattr(self, "plans"):
            self.plans.close()
        if hasattr(self, "comm"):
            self.comm.close()

    def _spawn(
        self, config: EngineConfig, rank: int, local_rank: int, warm_up: bool
    ) -> subprocess.Popen:
        env = dict(os.environ)
        env[ENV_WARM_UP] = "1" if warm_up else "0"
        env[ENV_CONFIG] = to_json(config)
        env[ENV_RANK], env[ENV_LOCAL_RANK] = str(rank), str(local_rank)
        env[ENV_PARENT] = str(os.getpid())
        cmd = [sys.executable, "-P", "-m", "stoker.services.worker.parallel.follower"]
        return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509

    def _watch(self, proc: subprocess.Popen, on_exit: Callable[[int, int], None] | None) -> None:
        code = proc.wait()
        if not self._stopping:
            log.error("tensor-parallel rank (pid %d) exited with %d", proc.pid, code)
            if on_exit is not None:
                on_exit(proc.pid, code)


def _die_with_parent() -> None:
    """In the child before exec: the kernel SIGKILLs it when the parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
