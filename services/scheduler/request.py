"""Scheduler-side request state."""

from __future__ import annotations

import enum
import time

from common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


class Request:
    # The three fields schedule()'s steady-decode loop touches come first, side by side (one
    # cache line): at hundreds of requests the loop runs with caches the other processes left
    # cold.
    __slots__ = (
        "req_id",
        "num_computed_tokens",
        "decode_until",
        "token_ids",
        "hash_at_len",
        "prompt_len",
        "params",
        "max_tokens",
        "token_limit",
        "stop_ids",
        "status",
        "num_cached_tokens",
        "num_preemptions",
        "needs_full_send",
        "finish_reason",
        "arrival_time",
        "first_scheduled_time",
        "spec_inflight",
        "spec_ema",
        "spec_paused",
        "ngram_index",
        "num_draft_tokens",
        "num_accepted_tokens",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: tuple[int, ...],
        arrival_time: float | None = None,
    ) -> None:
        self.req_id = req_id
        # One growing list (prompt then outputs), so per-step work never copies the context.
        self.token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.token_limit = 0  # the scheduler's: min(prompt_len + max_tokens, max_model_len)
        # The scheduler's steady-decode fast path (scheduler.py): while num_computed_tokens is
        # below decode_until, the request decodes one token a step into a block it holds, below
        # its limit, and at equality it stops (for one more block, or to key one); -1: not in
        # steady decode.
        # hash_at_len is the context length at which a block of known tokens may need keying
        # (never late; early only costs a check). A request in steady decode is always below
        # it: reaching it stops steady decode at the stop row, which keys the block.
        self.decode_until = -1
        self.hash_at_len = 0
        eos = () if params.ignore_eos else eos_token_ids
        self.stop_ids = frozenset(eos) | frozenset(params.stop_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first admission; -1 = not yet
        self.num_preemptions = 0
        self.needs_full_send = True  # the worker has no state for it (new or preempted)
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.spec_inflight = -1  # drafts in the verify step in flight; -1: no verify in flight
        self.spec_ema: float | None = None  # accepted drafts per verify (EMA); None: no verify yet
        self.spec_paused = 0  # steps in a row planned without drafts for low acceptance
        self.ngram_index = None
        self.num_draft_tokens = 0  # speculative tokens proposed for it, over all its verifies
        self.num_accepted_tokens = 0  # of those, accepted

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_placeholders(self) -> int:
        """Tokens being sampled by steps in flight, not yet known here (overlap scheduling).
        Derived, not counted, so steady decode keeps one counter per request instead of two: a
        verify in flight samples one; otherwise each planned position from the last known token
        on samples one (the last known token's own step samples the next)."""
        if self.spec_inflight >= 0:
            return 1
        return max(0, self.num_computed_tokens - len(self.token_ids) + 1)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus the ones steps in flight will sample."""
        return len(self.token_ids) + self.num_placeholders

    def is_done_after_inflight(self, max_model_len: int) -> bool:
        """Once the steps in flight return, this request must stop: schedule nothing more."""
        planned_outputs = self.num_output_tokens + self.num_placeholders
        return planned_outputs >= self.max_tokens or self.num_planned_tokens >= max_model_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Stops decided on token ids; stop strings are the detokenizer's job."""
        if self.token_ids[-1] in self.stop_ids:
            return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
