"""Messages between stoker processes. Every message is a msgspec Struct (array_like, tagged).

The scheduler -> worker plan is a diff against the previous step: new requests travel in full
once; running requests travel as a token count plus any new block ids; finished, aborted and
preempted requests travel as ids. So a plan's size does not grow with context length.
"""

from __future__ import annotations

import msgspec

from common.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the worker has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when a preempted request resumes
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    num_scheduled_tokens: int


class RunningRequestData(msgspec.Struct, array_like=True, gc=False):
    """Running requests in this step, as parallel lists (one entry per request)."""

    req_ids: list[str] = []
    num_scheduled_tokens: list[int] = []
    new_block_ids: list[list[int]] = []


class StepPlan(msgspec.Struct, array_like=True, gc=False, tag="plan"):
    step_id: int
    new_requests: list[NewRequestData]
    running: RunningRequestData
    finished_req_ids: list[str]  # drop worker state: finished, aborted or preempted

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.running.req_ids)


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class StepResult(msgspec.Struct, array_like=True, gc=False, tag="result"):
    """Sampled tokens for the requests that reached the end of their known tokens this step."""

    step_id: int
    req_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # aligned with req_ids when any asked
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
