"""OpenAI request bodies, decoded and type-checked by msgspec, and turned into internal requests.

Unknown parameters are rejected (forbid_unknown_fields) so a typo is a 400 naming the parameter
instead of a silently ignored setting. Fields beyond OpenAI's (top_k, min_p, ...) follow vLLM.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any, Literal

import msgspec

from stoker.common.messages import ChatMessage, TokenizeRequest, pack_ids
from stoker.common.sampling_params import SamplingParams


class ApiError(Exception):
    """An error the client caused (or a server error), rendered as OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# Wire types: every integer is checked against the type it travels as (msgpack int64, token
# ids int32) while decoding, so nothing out of range reaches an allocation or an encoder.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Float = Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)]  # finite: NaN and inf fail both bounds


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on what a client may ask for, checked before anything is allocated."""

    max_n: int = 128
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 1024  # characters per stop string
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # logit_bias entries
    max_top_logprobs: int = SamplingParams.MAX_LOGPROBS


DEFAULT_LIMITS = Limits()


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int32 | None = None
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, Float] | None = None  # OpenAI: token id (as a string) -> bias
    user: str | None = None
    # vLLM's: logprobs name tokens "token_id:N", so a client (stoker eval) gets exact ids.
    return_tokens_as_token_ids: bool = False


class CompletionRequest(_Common):
    prompt: Any  # str | list[int] | [str] | [list[int]]: msgspec unions allow one array type
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):  # lenient: clients add name, tool_call_id, ...
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessageIn]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True


# /tokenize and /detokenize, in vLLM's shapes. A body with `messages` is a chat request.
class TokenizeCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    messages: list[ChatMessageIn]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes the special tokens
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


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
                )
            )
        return out


def _wrap_int64(x: int) -> int:
    """seed + i stays an int64 (the wire type) for a seed near the top of the range."""
    return (x + 2**63) % 2**64 - 2**63


_PATH_RE = re.compile(r"at `\$\.(\w+)")  # "... - at `$.messages[0]`": the top-level param
_FIELD_RE = re.compile(r"field `(\w+)`")  # "Object contains unknown field `foo`"


def decode(body: bytes, cls: type[msgspec.Struct]) -> Any:
    if not body.strip():
        raise ApiError("the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        message = str(e)
        path, field = _PATH_RE.search(message), _FIELD_RE.search(message)
        param = path.group(1) if path else field.group(1) if field else None
        if "unknown field" in message and field and not path:
            message = f"Unrecognized request argument supplied: {field.group(1)}"
        raise ApiError(message, param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(f"We could not parse the JSON body of your request: {e}") from None
    except RecursionError:  # `prompt` is Any: deeply nested arrays recurse in the decoder
        raise ApiError("the JSON body is nested too deeply") from None


def _check_limits(req: _Common, limits: Limits) -> list[str]:
    """Bound every size the client chooses; return the stop strings as a list."""
    if req.n < 1:
        raise ApiError(f"n must be at least 1, got {req.n}", param="n")
    if req.n > limits.max_n:
        raise ApiError(f"n must be at most {limits.max_n}, got {req.n}", param="n")
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
    req: _Common, max_tokens: int | None, logprobs: int | None, limits: Limits
) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options is only allowed when stream is true", param="stream_options")
    stop = _check_limits(req, limits)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens is not None and max_tokens >= 2**31:  # no context is this long
        raise ApiError(f"max_tokens must be below 2**31, got {max_tokens}", param="max_tokens")
    given = {
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
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=_logit_bias(req.logit_bias),
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


def completion_generation(req: CompletionRequest, limits: Limits = DEFAULT_LIMITS) -> Generation:
    if req.echo:
        raise ApiError("echo is not supported", param="echo")
    prompt, ids = _completion_prompt(req.prompt)
    return Generation(
        kind="completion",
        model=req.model,
        params=_sampling_params(req, req.max_tokens, req.logprobs, limits),
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        prompt=prompt,
        prompt_token_ids=ids,
    )


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


def chat_messages(given: list[ChatMessageIn]) -> list[ChatMessage]:
    """Messages as the chat template sees them: text parts joined, no content as ""."""
    if not given:
        raise ApiError("messages must not be empty", param="messages")
    messages = []
    for m in given:
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise ApiError("only text content parts are supported", param="messages")
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        messages.append(ChatMessage(m.role, content))
    return messages


def chat_generation(req: ChatRequest, limits: Limits = DEFAULT_LIMITS) -> Generation:
    messages = chat_messages(req.messages)
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
    return Generation(
        kind="chat",
        model=req.model,
        params=_sampling_params(req, max_tokens, logprobs, limits),
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        messages=messages,
        add_generation_prompt=req.add_generation_prompt,
    )
