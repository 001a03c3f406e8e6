"""Scheduler-side request state."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import msgspec

from stoker.common.messages import TokenLogprobs
from stoker.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from stoker.services.scheduler.speculation import NgramIndex

NOT_STEADY = -1  # a steady_until below every computed count
NO_VERIFY_IN_FLIGHT = -1  # a spec_inflight no verify has (a verify may carry 0 drafts)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


class Request:
    # The fields the steady loop (steady.py) touches come first, side by side (close together in
    # memory): at hundreds of requests the loop runs with caches the other processes left cold.
    __slots__ = (
        "req_id",
        "num_computed_tokens",
        "steady_until",
        "token_ids",
        "next_key_len",
        "prompt_len",
        "params",
        "max_tokens",
        "max_len",
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
        "grammar_mask_s",
        "forced",
        "forced_inflight",
        "num_forced_tokens",
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
        self.max_len = 0  # the scheduler's: min(prompt_len + max_tokens, max_model_len)
        # The steady path (steady.py, docs/steady-decode.md): while num_computed_tokens is below
        # steady_until, the request decodes one token a step into a block it holds, below its
        # limit, and at equality it stops (for one more block, or to key one).
        # next_key_len is the context length at which a block of known tokens may need keying
        # (never late; early only costs a check). A steady request is always below it: reaching
        # it ends steady decode at the stop row, which keys the block.
        self.steady_until = NOT_STEADY
        self.next_key_len = 0
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
        self.spec_inflight = NO_VERIFY_IN_FLIGHT  # else: the drafts of the verify in flight
        self.spec_ema: float | None = None  # accepted drafts per verify (EMA); None: no verify yet
        self.spec_paused = 0  # steps in a row planned without drafts for low acceptance
        self.ngram_index: NgramIndex | None = None
        self.num_draft_tokens = 0  # speculative tokens proposed for it, over all its verifies
        self.num_accepted_tokens = 0  # of those, accepted
        self.grammar_mask_s = 0.0  # its share of the worker's grammar-mask time (structured)
        # Fast-forward (docs/structured-outputs.md): the tokens its grammar forces after its last
        # known token, proposed as its next drafts; whether the verify in flight checks them;
        # and how many of them were accepted.
        self.forced: list[int] = []
        self.forced_inflight = False
        self.num_forced_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_placeholders(self) -> int:
        """Tokens being sampled by steps in flight, not yet known here (overlap scheduling).
        Derived, not counted, so steady decode keeps one counter per request instead of two: a
        verify in flight samples one; otherwise each planned position from the last known token
        on samples one (the last known token's own step samples the next)."""
        if self.spec_inflight != NO_VERIFY_IN_FLIGHT:
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


class RequestUpdate(msgspec.Struct, gc=False):
    """What one step produced for one request: new token(s), and whether it finished. (A
    struct, not a dataclass: one is made per running request per step, at half the cost.)"""

    req_id: str
    new_token_ids: list[int]
    request: Request
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    # On a request's first update, when it asked for prompt logprobs: one per prompt token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
