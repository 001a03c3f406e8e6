"""A decoded request -> `Generation`: the sampling parameters, the prompt or messages, the
tools and the output constraint, as the server runs them (n sub-requests for the tokenizers),
and what the response shows of the prompt (echo, prompt_logprobs: prompt_logprob_render.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from stoker.common.messages import ChatMessage, TokenizeRequest, pack_ids
from stoker.common.sampling_params import SamplingParams, StructuredOutput
from stoker.services.api.chat_messages import chat_messages
from stoker.services.api.chat_tools import NO_TOOLS, ToolPlan, tool_plan
from stoker.services.api.errors import ApiError
from stoker.services.api.openai_schema import (
    DEFAULT_LIMITS,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    Limits,
)
from stoker.services.api.prompt_logprob_render import NOTHING_SHOWN, PromptShown
from stoker.services.api.structured_request import (
    REMOVED_GUIDED_FIELDS,
    compact_json,
    reject_removed,
    structured_output,
)

if TYPE_CHECKING:
    from stoker.common.tool_calls import ToolFormat


@dataclasses.dataclass
class Generation:
    """One API call, as the server runs it: n sub-requests sharing a prompt."""

    kind: Literal["completion", "chat"]
    model: str | None
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: ToolPlan = NO_TOOLS
    tool_format: str = ""  # the format's name, when tools or past calls are in play
    chat_template_kwargs: str | None = None  # a JSON object
    continue_final_message: bool = False
    shown: PromptShown = NOTHING_SHOWN  # what the response shows of the prompt

    def sub_requests(self, req_id: str, arrival_time: float) -> list[TokenizeRequest]:
        out = []
        for i in range(self.n):
            params = self.params
            if self.params.seed is not None and self.n > 1:
                params = msgspec.structs.replace(params, seed=_wrap_int64(self.params.seed + i))
            out.append(
                TokenizeRequest(
                    f"{req_id}-{i}",
                    params,
                    prompt=self.prompt,
                    prompt_token_ids=(
                        None if self.prompt_token_ids is None else pack_ids(self.prompt_token_ids)
                    ),
                    messages=self.messages,
                    add_generation_prompt=self.add_generation_prompt,
                    arrival_time=arrival_time,
                    tools=self.tools.tools,
                    chat_template_kwargs=self.chat_template_kwargs,
                    continue_final_message=self.continue_final_message,
                    tool_format=self.tool_format,
                    return_prompt_ids=self.shown.wants_prompt,
                    return_prompt_text=self.shown.echo and self.prompt is None,
                )
            )
        return out


def _wrap_int64(x: int) -> int:
    """seed + i stays an int64 (the wire type) for a seed near the top of the range."""
    return (x + 2**63) % 2**64 - 2**63


def _n(req: BaseRequest) -> int:
    return 1 if req.n is None else req.n


def _check_limits(req: BaseRequest, limits: Limits) -> list[str]:
    """Bound every size the client chooses; return the stop strings as a list."""
    n = _n(req)
    if n < 1:
        raise ApiError(f"n must be at least 1, got {n}", param="n")
    if n > limits.max_n:
        raise ApiError(f"n must be at most {limits.max_n}, got {n}", param="n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop:
        raise ApiError(f"at most {limits.max_stop} stop strings are allowed", param="stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise ApiError(
            f"stop strings must be at most {limits.max_stop_chars} characters", param="stop"
        )
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise ApiError(
            f"at most {limits.max_stop_token_ids} stop_token_ids are allowed",
            param="stop_token_ids",
        )
    if req.logit_bias and len(req.logit_bias) > limits.max_logit_bias:
        raise ApiError(
            f"logit_bias may have at most {limits.max_logit_bias} entries", param="logit_bias"
        )
    return stop


def _sampling_params(
    req: BaseRequest,
    max_tokens: int | None,
    logprobs: int | None,
    limits: Limits,
    structured: StructuredOutput | None = None,
    skip_special_tokens: bool = True,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options is only allowed when stream is true", param="stream_options")
    stop = _check_limits(req, limits)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens is not None and max_tokens >= 2**31:  # no context is this long
        raise ApiError(f"max_tokens must be below 2**31, got {max_tokens}", param="max_tokens")
    given: dict[str, Any] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    params = SamplingParams(
        n=1,  # the api fans out n sub-requests itself
        max_tokens=max_tokens,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        logit_bias=_logit_bias(req.logit_bias),
        structured=structured,
        **{k: v for k, v in given.items() if v is not None},
    )
    try:
        params.validate()
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        raise ApiError(str(e), param=first if hasattr(req, first) else None) from None
    return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for token, value in bias.items():
        # int() of a long digit string is quadratic; a token id has at most 10 digits.
        key = token.strip()
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= 2**31:
            raise ApiError("logit_bias keys must be token ids", param="logit_bias")
        if not math.isfinite(value):
            raise ApiError("logit_bias values must be finite", param="logit_bias")
        out[int(key)] = float(value)
    return out


def _structured(req: BaseRequest) -> StructuredOutput | None:
    reject_removed({name: getattr(req, name) for name in REMOVED_GUIDED_FIELDS})
    return structured_output(req.response_format, req.structured_outputs)


def completion_generation(req: CompletionRequest, limits: Limits = DEFAULT_LIMITS) -> Generation:
    if req.best_of is not None and req.best_of != _n(req):
        raise ApiError(
            "best_of other than n is not supported (there is no server-side ranking); "
            "ask for n choices and pick",
            param="best_of",
        )
    if req.suffix:
        raise ApiError("suffix is not supported (no insertion)", param="suffix")
    prompt, ids = _completion_prompt(req.prompt)
    skip = req.skip_special_tokens is not False
    echo = bool(req.echo)
    shown = PromptShown(
        echo=echo,
        text=prompt if echo else None,
        echo_logprobs=req.logprobs if echo else None,  # vLLM's: echo's k is logprobs'
        prompt_logprobs=_prompt_logprobs(req, limits),
        # max_tokens 0 (OpenAI's echo-only request): the engine always generates a token, so
        # ask for one and show none of it (prompt_logprob_render.drop_output).
        drop_output=echo and req.max_tokens == 0,
    )
    max_tokens = 1 if shown.drop_output else req.max_tokens
    structured = _structured(req)
    return Generation(
        kind="completion",
        model=req.model,
        params=_sampling_params(
            req, max_tokens, req.logprobs, limits, structured, skip, shown.engine_k
        ),
        n=_n(req),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        prompt=prompt,
        prompt_token_ids=ids,
        shown=shown,
    )


def _prompt_logprobs(req: BaseRequest, limits: Limits) -> int | None:
    """vLLM's prompt_logprobs: its k, or None when nothing is to be shown."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if not 0 <= k <= limits.max_top_logprobs:
        raise ApiError(
            f"prompt_logprobs must be in [0, {limits.max_top_logprobs}], got {k} "
            "(-1, the whole vocabulary, is not supported)",
            param="prompt_logprobs",
        )
    if req.stream:
        if k > 0:  # vLLM's check (protocol.py check_logprobs), and its message
            raise ApiError(
                "`prompt_logprobs` are not available when `stream=True`.",
                param="prompt_logprobs",
            )
        return None  # 0: accepted and, as in vLLM's streams, shown nowhere: not computed
    return k


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _completion_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_ids(prompt):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("the prompt is empty", param="prompt")
        return prompt, None
    if _is_ids(prompt):
        if not prompt:
            raise ApiError("the prompt is empty", param="prompt")
        if not all(0 <= t < 2**31 for t in prompt):  # ids travel as int32 (pack_ids)
            raise ApiError("prompt token ids must be non-negative vocabulary ids", param="prompt")
        return None, prompt
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    ):
        raise ApiError("only one prompt per request is supported", param="prompt")
    raise ApiError(
        "prompt must be a string, a list of token ids, or a list holding one of those",
        param="prompt",
    )


def chat_generation(
    req: ChatRequest, limits: Limits = DEFAULT_LIMITS, tool_format: ToolFormat | None = None
) -> Generation:
    """tool_format: the model's tool-call format (common/tool_calls), which parses calls out of
    the output; without one, a request that needs calls parsed is a 400."""
    _reject_unsupported(req)
    messages = chat_messages(req.messages)
    add_generation_prompt = req.add_generation_prompt is not False
    if req.continue_final_message:
        _check_continue(req, add_generation_prompt)
    tools = tool_plan(
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        req.functions,
        req.function_call,
        tool_format.name if tool_format is not None else "",
    )
    if tools.parse and tool_format is None:
        raise ApiError("this server has no tool-call format for its model", param="tools")
    structured = _chat_structured(req, tools)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= limits.max_top_logprobs:
        raise ApiError(
            f"top_logprobs must be in [0, {limits.max_top_logprobs}], got {req.top_logprobs}",
            param="top_logprobs",
        )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # max_completion_tokens supersedes max_tokens; neither: up to the context length.
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    # A format whose markers are special tokens must see them to parse calls; its parser
    # strips the markers it consumed, so the client never does.
    skip = req.skip_special_tokens is not False
    if tools.parse and tool_format is not None and tool_format.keeps_special_tokens:
        skip = False
    shown = PromptShown(prompt_logprobs=_prompt_logprobs(req, limits))
    return Generation(
        kind="chat",
        model=req.model,
        params=_sampling_params(
            req, max_tokens, logprobs, limits, structured, skip, shown.engine_k
        ),
        n=_n(req),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        tool_format=_format_name(tool_format, tools, messages),
        chat_template_kwargs=_template_kwargs(req.chat_template_kwargs),
        continue_final_message=bool(req.continue_final_message),
        shown=shown,
    )


def _format_name(
    tool_format: ToolFormat | None, tools: ToolPlan, messages: list[ChatMessage]
) -> str:
    """The format, for the tokenizer to render tools and past calls with; "" without them."""
    in_play = tools.tools is not None or any(m.tool_calls or m.tool_call_id for m in messages)
    return tool_format.name if in_play and tool_format is not None else ""


def _reject_unsupported(req: ChatRequest) -> None:
    """Fields that ask for what stoker cannot do: a 400 saying so, never a silent ignore."""
    if req.audio is not None or (req.modalities and "audio" in req.modalities):
        param = "audio" if req.audio is not None else "modalities"
        raise ApiError("audio output is not supported: stoker answers in text", param=param)
    if req.web_search_options is not None:
        raise ApiError("web search is not available on this server", param="web_search_options")
    if req.moderation is not None:
        raise ApiError("moderation is not available on this server", param="moderation")


def _chat_structured(req: ChatRequest, tools: ToolPlan) -> StructuredOutput | None:
    """The one constraint on the output: the request's, or the grammar forcing calls."""
    structured = _structured(req)
    if structured is None or not tools.parse:
        return tools.structured or structured
    if tools.structured is not None:
        # A forced call is this turn's whole output: the answer format applies to a later turn
        # (OpenAI accepts the pair; the Agents SDK sends it for a required tool and an output
        # type, then resets tool_choice to auto).
        return tools.structured
    if structured.kind not in ANSWER_KINDS:
        raise ApiError(
            f"a {structured.kind} grammar together with tools under tool_choice auto is not "
            "supported; send tool_choice none, or a JSON schema, a regex or choices",
            param="tool_choice",
        )
    # Either calls in the model's format or an answer in the requested format: one grammar
    # allowing both (services/tokenizer/grammar_compile.py), as agents with an output type ask.
    assert tools.tools is not None
    spec = {
        "format": tools.format,
        "tools": json.loads(tools.tools),
        "choice": "auto",
        "parallel": tools.parallel,
        "answer": {"kind": structured.kind, "spec": structured.spec},
    }
    return StructuredOutput(kind="tool_calls", spec=json.dumps(spec, separators=(",", ":")))


# Output formats a grammar can offer beside tool calls under tool_choice auto.
ANSWER_KINDS = ("json_schema", "json_object", "regex", "choice")


def _check_continue(req: ChatRequest, add_generation_prompt: bool) -> None:
    if add_generation_prompt:
        raise ApiError(
            "continue_final_message needs add_generation_prompt false (they contradict: one "
            "extends the last message, the other opens a new one)",
            param="continue_final_message",
        )
    if req.messages[-1].role != "assistant":
        raise ApiError(
            "continue_final_message needs the last message to be an assistant message",
            param="continue_final_message",
        )


# apply_chat_template's own arguments and what the request sets itself: not template variables.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
    }
)


def _template_kwargs(kwargs: dict[str, Any] | None) -> str | None:
    if not kwargs:
        return None
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ApiError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields "
            "set those",
            param="chat_template_kwargs",
        )
    return compact_json(kwargs, "chat_template_kwargs")
