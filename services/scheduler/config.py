"""The scheduler's settings: the core's (SchedulerConfig) and the process's, whose fields are
its flags (common/config_args.py). Light to import: `stoker serve` reads it for the flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stoker.common.config import STEP_TIMEOUT_S, EngineConfig
from stoker.common.config_args import flag


@dataclasses.dataclass
class SchedulerConfig:
    """The core's policy knobs. Served engines build it from their EngineConfig (from_engine);
    the defaults are for tests and benchmarks that drive the core alone."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Prompt-chunk tokens per step (requests computing more than one token, a prompt or a
    # recompute after preemption); decodes and verifies are not counted. 0: only
    # max_num_batched_tokens caps them. Small chunks let each prompt of a wave start decoding
    # as soon as its own chunk is done instead of when the wave's is.
    prefill_chunk_tokens: int = 0
    max_model_len: int = 2048
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests

    @classmethod
    def from_engine(cls, engine: EngineConfig, max_model_len: int) -> SchedulerConfig:
        """The engine's flags; max_model_len as the worker resolved it for its pool."""
        assert engine.prefill_chunk_tokens is not None  # EngineConfig resolves it
        return cls(
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            prefill_chunk_tokens=engine.prefill_chunk_tokens,
            max_model_len=max_model_len,
        )


@dataclass
class SchedulerServiceConfig:
    """The scheduler process's settings: the engine's, and two of its own (`stoker serve`
    imports this for them, so the service itself loads only in main)."""

    engine: EngineConfig
    no_overlap: bool = flag(
        False, "disable overlap scheduling: one step in flight at a time", switch=True
    )
    step_timeout_s: float = STEP_TIMEOUT_S.field()
