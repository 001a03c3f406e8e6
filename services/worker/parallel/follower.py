"""A rank other than 0 (`python -m stoker.services.worker.parallel.follower`, spawned by
ranks.py; or the worker process itself on a node other than 0). It runs every plan rank 0 forwards,
exactly as rank 0 does, and answers nobody: its sampled tokens equal rank 0's."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

from stoker.common.config import EngineConfig
from stoker.common.ipc import plan_decoder
from stoker.common.messages import ProfileControl, SchedulerHello
from stoker.services.worker.model_runner import ModelRunner
from stoker.services.worker.parallel.plan_channel import PlanChannel
from stoker.services.worker.parallel.ranks import (
    ENV_CONFIG,
    ENV_LOCAL_RANK,
    ENV_PARENT,
    ENV_RANK,
    ENV_WARM_UP,
    connect,
    rank_config,
)
from stoker.services.worker.warmup import warm_up

log = logging.getLogger("stoker.worker")


def follow(runner: ModelRunner, plans: PlanChannel) -> None:
    """Until rank 0 says stop or goes away."""
    while (raw := plans.recv()) is not None:
        msg = plan_decoder.decode(raw)  # rank 0 decoded it already: it is well formed
        if isinstance(msg, SchedulerHello):
            runner.forget_requests()
        elif isinstance(msg, ProfileControl):
            continue  # only rank 0 profiles
        else:
            try:
                runner.execute(msg)
            except Exception:  # rank 0 fails the same way on the same plan, and goes on
                log.exception("step %d failed; dropped", msg.step_id)


def main() -> None:
    logging.basicConfig(level=os.environ.get("STOKER_LOG_LEVEL", "INFO"))
    if os.getppid() != int(os.environ[ENV_PARENT]):
        sys.exit(1)  # the parent died before PR_SET_PDEATHSIG took hold
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    raw = json.loads(os.environ[ENV_CONFIG])
    config = EngineConfig(**{k: v for k, v in raw.items() if k in fields})
    rank, local_rank = int(os.environ[ENV_RANK]), int(os.environ[ENV_LOCAL_RANK])
    config = rank_config(config, local_rank)
    comm = connect(config, rank)
    plans = PlanChannel(comm, config.master_addr, config.nnodes == 1)
    runner = ModelRunner(config, comm)
    if os.environ.get(ENV_WARM_UP) == "1":
        warm_up(runner)
    try:
        follow(runner, plans)
    except RuntimeError as e:  # gloo/NCCL mid-step: rank 0 is gone
        log.info("rank %d: rank 0 went away (%s); exiting", rank, e)
    plans.close()
    comm.close()


if __name__ == "__main__":
    main()
