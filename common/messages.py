"""Messages between stoker processes. Every message is a msgspec Struct (array_like, tagged).

The scheduler -> worker plan is a diff against the previous step: new requests travel in full
once; running requests travel as a token count plus any new block ids; finished, aborted and
preempted requests travel as ids. So a plan's size does not grow with context length.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import msgspec
import numpy as np

from stoker.common.sampling_params import SamplingParams
from stoker.common.telemetry import StepTelemetry

TokenIds = bytes
"""Token ids on the wire: one little-endian int32 buffer. A msgpack list[int] decodes into one
Python object per id; a buffer decodes with one copy, and numpy or torch produce it directly."""

_ID_DTYPE = np.dtype("<i4")
_SWAP = sys.byteorder != "little"  # array("i") is native-endian; the wire is little-endian
assert array("i").itemsize == 4


_pack_one = struct.Struct("<i").pack
_unpack_one = struct.Struct("<i").unpack


def unpack_one_id(buf: TokenIds) -> int:
    """The id of a one-id buffer (a decode step's token): cheaper than unpack_ids."""
    return _unpack_one(buf)[0]


def pack_ids(ids: Sequence[int] | np.ndarray) -> TokenIds:
    if type(ids) is list and len(ids) == 1:  # a decode step's token: 3x cheaper than array
        return _pack_one(ids[0])
    if isinstance(ids, np.ndarray):
        return ids.astype(_ID_DTYPE, copy=False).tobytes()
    buf = array("i", ids)  # ~3x cheaper than numpy for the few ids of a step's message
    if _SWAP:
        buf.byteswap()
    return buf.tobytes()


def unpack_ids(buf: TokenIds) -> list[int]:
    ids = array("i", buf)
    if _SWAP:
        ids.byteswap()
    return ids.tolist()


def num_ids(buf: TokenIds) -> int:
    return len(buf) // 4


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the worker has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds  # non-empty when a preempted request resumes
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    num_scheduled_tokens: int


class RunningRequestData(msgspec.Struct, array_like=True, gc=False):
    """Running requests in this step, as parallel lists (one entry per request)."""

    req_ids: list[str] = []
    num_scheduled_tokens: list[int] = []  # 1 + number of draft tokens when speculating
    new_block_ids: list[list[int]] = []
    # Speculation, one entry per request: draft ids proposed by the scheduler (n-gram), or the
    # number of drafts the worker's draft model must propose. [] / 0 when not speculating.
    spec_token_ids: list[TokenIds] = []
    num_spec_tokens: list[int] = []


class StepPlan(msgspec.Struct, array_like=True, gc=False, tag="plan"):
    step_id: int
    new_requests: list[NewRequestData]
    running: RunningRequestData
    finished_req_ids: list[str]  # drop worker state: finished, aborted or preempted
    sent_at: float = 0.0  # time.time() when sent, for IPC telemetry

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.running.req_ids)


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One prompt chunk's prompt logprobs for one request (SamplingParams.prompt_logprobs):
    entries[i] is prompt token first + i given the tokens before it. Token 0 has none, so
    first >= 1."""

    req_id: str
    first: int
    entries: list[TokenLogprobs]


class StepResult(msgspec.Struct, array_like=True, gc=False, tag="result"):
    """Sampled tokens for the requests that reached the end of their known tokens this step."""

    step_id: int
    req_ids: list[str]
    token_ids: TokenIds  # flat; request i contributed counts[i] of them (1 when counts is None)
    counts: list[int] | None = None  # set when some request speculated
    logprobs: list[TokenLogprobs | None] | None = None  # aligned with token_ids when any asked
    prepare_s: float = 0.0
    forward_s: float = 0.0  # device time: CUDA events on CUDA, the forward's wall time on CPU
    sample_s: float = 0.0
    idle_s: float = 0.0  # worker time spent waiting for this plan (the device's idle gap)
    plan_ipc_s: float = 0.0  # plan transit + decode
    sent_at: float = 0.0  # time.time() when sent
    forward_host_s: float = 0.0  # host wall time around the forward (launches, on CUDA)
    num_tokens: int = 0  # tokens the forward ran over (prefill chunks, decodes, drafts)
    num_reqs: int = 0  # requests in the step
    # Structured outputs (worker/grammar.py): the grammar thread's time on the step's masks,
    # and how long sampling waited for them after the forward (the part it did not hide).
    grammar_mask_s: float = 0.0
    grammar_wait_s: float = 0.0
    # Fast-forward: structured requests whose grammar forces the next tokens, and those tokens,
    # for the scheduler to propose as drafts (docs/structured-outputs.md).
    forced_req_ids: list[str] = []
    forced_token_ids: list[TokenIds] = []
    # Prompt logprobs of the prompt chunks computed this step, for the requests that asked.
    prompt_logprobs: list[PromptLogprobs] | None = None


# --- api <-> tokenizer <-> scheduler ---------------------------------------------------------


class ChatMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None  # a tool result answers this call
    tool_calls: str | None = None  # an assistant's calls: OpenAI's tool_calls list, JSON text


class TokenizeRequest(msgspec.Struct, array_like=True, tag="tokenize"):
    """api -> tokenizer. Exactly one of prompt, prompt_token_ids, messages is set."""

    req_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: TokenIds | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    arrival_time: float = 0.0  # time.time() at the api, for queue/TTFT metrics
    return_prompt_ids: bool = False  # --log-requests, echo: send the prompt ids in the first delta
    tools: str | None = None  # the tools the chat template renders: OpenAI's list, JSON text
    chat_template_kwargs: str | None = None  # extra template variables (vLLM's), a JSON object
    continue_final_message: bool = False  # extend the last (assistant) message (vLLM's)
    tool_format: str = ""  # the tool-call format (common/tool_calls) when tools are in play
    return_prompt_text: bool = False  # echo of a token-id prompt: its text in the first delta


class GenerateRequest(msgspec.Struct, array_like=True, gc=False, tag="generate"):
    """tokenizer -> scheduler. The scheduler replies to the tokenizer that sent it."""

    req_id: str
    prompt_token_ids: TokenIds
    params: SamplingParams
    arrival_time: float = 0.0


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    """api or tokenizer -> scheduler: drop these requests and free their blocks. Unknown ids are
    ignored. `reason` is 'abort' (client went away) or 'stop' (a stop string matched)."""

    req_ids: list[str]
    reason: str = "abort"


class RequestTokens(msgspec.Struct, array_like=True, gc=False):
    """New tokens for one request from one step (several when speculating)."""

    req_id: str
    token_ids: TokenIds
    finish_reason: str | None = None  # stop | length | abort
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0  # set on the first message of a request
    num_cached_tokens: int = 0  # prefix-cache hit, set on the first message
    queue_s: float = 0.0  # time from arrival to first schedule, set on the first message
    error: str | None = None  # the scheduler rejected the request (finish_reason "abort")
    error_status: int = 400  # 503: the engine lost it (the client may retry)
    # Speculation for this request so far (cumulative; 0 when it never speculated). On every
    # message, not only the last: a stop string ends the request at a non-final one.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    grammar_mask_s: float = 0.0  # on the last message: its share of the worker's mask time
    num_forced_tokens: int = 0  # on the last message: fast-forwarded tokens accepted
    # On the first message, when the request asked (SamplingParams.prompt_logprobs): one entry
    # per prompt token, None for the first (vLLM's shape).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class TokenBatch(msgspec.Struct, array_like=True, gc=False, tag="tokens"):
    """scheduler -> tokenizer: one message per tokenizer per step.

    Most rows of a decode step are steady: one token of an announced request that goes on, with
    no logprobs and no speculation stats. Those travel as two columns (ids, and their tokens
    packed in the same order), which cost a fifth of RequestTokens items to encode and decode;
    every other row is an item. A request is in one or the other, never both."""

    items: list[RequestTokens]
    steady_req_ids: list[str] = []
    steady_token_ids: TokenIds = b""


class TextDelta(msgspec.Struct, array_like=True, gc=False):
    req_id: str
    text: str
    token_ids: TokenIds
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_s: float = 0.0
    error: str | None = None  # request rejected (e.g. prompt too long): 400 with this message
    error_status: int = 400  # 503 when the server lost the request (its tokenizer died)
    num_draft_tokens: int = 0  # cumulative, as in RequestTokens
    num_accepted_tokens: int = 0
    prompt_token_ids: TokenIds | None = None  # first delta, when TokenizeRequest asked for them
    # Structured outputs (docs/structured-outputs.md), on the first delta: the grammar's compile
    # time in the tokenizer process, and whether its cache answered.
    grammar_compile_s: float = 0.0
    grammar_cache_hit: bool = False
    grammar_mask_s: float = 0.0  # on the last delta (RequestTokens')
    num_forced_tokens: int = 0  # on the last delta (RequestTokens')
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first delta (RequestTokens')
    prompt_text: str | None = None  # first delta, when TokenizeRequest asked for it


class TextBatch(msgspec.Struct, array_like=True, gc=False, tag="text"):
    """tokenizer -> api: detokenized deltas, batched per step. Steady rows (see TokenBatch) are
    columns here too: each is TextDelta(req_id, text, token_ids) with every other field at its
    default."""

    tokenizer_id: str
    items: list[TextDelta]
    steady_req_ids: list[str] = []
    steady_texts: list[str] = []
    steady_token_ids: TokenIds = b""  # one packed id per steady row


class TokenizerHeartbeat(msgspec.Struct, array_like=True, tag="tok_heartbeat"):
    tokenizer_id: str  # fresh per process: a restart is a new incarnation, never a reused id
    pid: int
    requests_served: int
    slot: str = ""  # what survives a restart (--id, or the host): a new id here replaces the old
    protocol: str = ""  # common/wire_digest.py: the api refuses a tokenizer from another build


class SpecStats(msgspec.Struct, array_like=True, gc=False):
    """Speculative decoding counters, cumulative."""

    drafts: int = 0  # verify steps run for a request
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = []  # [j]: drafts whose position j was accepted
    disabled_steps: int = 0  # steps where adaptive speculation switched off for batch size
    paused_drafts: int = 0  # request-steps that sat out drafts for low acceptance (adaptive)


class SchedulerStats(msgspec.Struct, array_like=True, tag="sched_stats"):
    """scheduler -> api, a few times a second and whenever the engine goes idle."""

    worker_ready: bool
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    prefix_queries: int  # cumulative, in tokens
    prefix_hits: int
    num_preemptions: int
    max_model_len: int
    model_name: str
    telemetry: StepTelemetry | None = None
    spec: SpecStats | None = None
    protocol: str = ""  # common/wire_digest.py: the api refuses a scheduler from another build


class WorkerReady(msgspec.Struct, array_like=True, tag="worker_ready"):
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    incarnation: str = ""  # the SchedulerHello answered; "" when sent unasked at start-up
    protocol: str = ""  # common/wire_digest.py: the scheduler refuses a worker from another build


class SchedulerHello(msgspec.Struct, array_like=True, tag="hello"):
    """scheduler -> worker on the plan socket, at start and after losing the worker: answer with
    WorkerReady and forget every request. Idempotent, so either side can restart."""

    incarnation: str
    protocol: str = ""  # common/wire_digest.py: the worker logs a scheduler from another build


class EngineFailure(msgspec.Struct, array_like=True, tag="engine_failure"):
    """scheduler -> api: these requests are lost (req_ids None: all of them, the worker is
    gone or stalled). The api ends them with a 503 or an SSE error event."""

    message: str
    req_ids: list[str] | None = None


class ProfileControl(msgspec.Struct, array_like=True, tag="profile"):
    """api -> scheduler (which applies it too) -> worker on the plan socket: start or stop the
    torch profiler (`--profile-dir`). num_steps 0: until a stop."""

    action: str  # start | stop
    num_steps: int = 0
    record_shapes: bool = False
    with_stack: bool = False


ApiInbound = TextBatch | TokenizerHeartbeat | SchedulerStats
ApiFromScheduler = SchedulerStats | EngineFailure
SchedulerInbound = GenerateRequest | Abort | ProfileControl
WorkerInbound = StepPlan | SchedulerHello | ProfileControl
