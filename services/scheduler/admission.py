"""Admission: the checks a request passes before it joins a scheduler core, shared by the
scheduler process and the offline engine (`services/engine/core.py`), so both refuse the same
requests with the same messages."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from stoker.common.model_config import ModelConfig
from stoker.common.sampling_params import SamplingParams
from stoker.common.validation import check_request
from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.request import Request
from stoker.services.scheduler.scheduler import Scheduler


def arrival_monotonic(wall: float) -> float | None:
    """The api's arrival (time.time(), comparable across processes and hosts) on this process's
    monotonic clock, which the core measures queue time with; None (now) when the peer did not
    set it. A clock skew that puts it in the future counts as now."""
    if wall <= 0.0:
        return None
    return time.monotonic() - max(0.0, time.time() - wall)


@dataclass(frozen=True, slots=True)
class Admission:
    """One core's limits: the context length the worker serves, the vocabulary, the KV pool."""

    scheduler: Scheduler
    blocks: BlockManager
    max_model_len: int
    model_cfg: ModelConfig

    def check(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """The request's max_tokens; ValueError (the client's 400) when it cannot be served."""
        max_tokens = check_request(prompt, params, self.max_model_len, self.model_cfg.vocab_size)
        self.blocks.check_prompt(len(prompt))
        return max_tokens

    def add(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Check the request and queue it; arrival_time on the monotonic clock (None: now)."""
        max_tokens = self.check(prompt, params)
        request = Request(
            req_id,
            prompt,
            params,
            max_tokens,
            self.model_cfg.eos_token_ids,
            arrival_time=arrival_time,
        )
        self.scheduler.add_request(request)
