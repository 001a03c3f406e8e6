"""The scheduler's settings: the core's (SchedulerConfig) and the process's, whose fields are
its flags (common/config_args.py). Light to import: `stoker serve` reads it for the flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config import STEP_TIMEOUT_S, EngineConfig
from common.config_args import flag


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Prompt-chunk tokens per step (requests computing more than one token, a prompt or a
    # recompute after preemption); decodes and verifies are not counted. 0: only
    # max_num_batched_tokens caps them. Small chunks let each prompt of a wave start decoding
    # as soon as its own chunk is done instead of when the wave's is.
    prefill_chunk_tokens: int = 0
    max_model_len: int = 2048
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests


@dataclass
class SchedulerServiceConfig:
    """The scheduler process's settings: the engine's, and two of its own (`stoker serve`
    imports this for them, so the service itself loads only in main)."""

    engine: EngineConfig
    no_overlap: bool = flag(
        False, "disable overlap scheduling: one step in flight at a time", switch=True
    )
    step_timeout_s: float = STEP_TIMEOUT_S.field()
