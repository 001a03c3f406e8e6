"""OpenAI request bodies, decoded and type-checked by msgspec.

Unknown parameters are rejected (forbid_unknown_fields) so a typo is a 400 naming the parameter
instead of a silently ignored setting. Every field the official `openai` client can send is
either honoured, accepted as a no-op (ACCEPTED_NO_OPS says why), or a 400 saying that stoker
cannot do what it asks; null is accepted wherever the client may send it. Fields beyond OpenAI's
(top_k, min_p, structured_outputs, ...) follow vLLM. Tools: chat_tools.py; structured outputs:
structured_request.py; messages: chat_messages.py; the request as the server runs it:
generation.py.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

import msgspec

from stoker.common.sampling_params import SamplingParams
from stoker.services.api.chat_messages import ChatMessageIn, ContentPart
from stoker.services.api.chat_messages import chat_messages as chat_messages  # tokenize_routes
from stoker.services.api.chat_tools import FunctionCallChoice, FunctionDef, Tool, ToolChoice
from stoker.services.api.errors import ApiError
from stoker.services.api.structured_request import ResponseFormat, StructuredOutputsIn

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


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no-op: stoker pads no stream events


# Fields accepted and ignored, and why: exposed for the docs and checked by the tests.
ACCEPTED_NO_OPS: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; stoker monitors nothing",
    "metadata": "tags for stored completions; stoker stores none",
    "store": "stores the completion for OpenAI's evals; stoker stores none",
    "service_tier": "OpenAI's billing tier; one tier here",
    "prompt_cache_key": "OpenAI's cache routing hint; stoker's prefix cache matches on tokens",
    "prompt_cache_options": "OpenAI's cache breakpoints; stoker caches every full block",
    "prompt_cache_retention": "OpenAI's cache lifetime; stoker evicts least recently used",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring; stoker monitors nothing",
    "parallel_tool_calls": "without tools there are no calls to limit (with tools: honoured)",
    "verbosity": "a knob of OpenAI's reasoning models; stoker passes nothing to the model",
    "reasoning_effort": "a knob of reasoning models; for a template with a thinking switch use "
    "chat_template_kwargs (e.g. enable_thinking)",
    "prediction": "predicted output, accepted and unused (it could feed speculative decoding "
    "as draft tokens, as n-gram proposals do)",
    "modalities": '["text"] is what every answer is; "audio" is a 400',
    "stream_options.include_obfuscation": "stoker pads no stream events",
    "response_format.json_schema.strict": "the schema is enforced exactly either way",
    "response_format.json_schema.description": "the model sees only what the prompt says",
    "tools[].function.strict": "a forced call follows the schema exactly either way",
    "structured_outputs.disable_fallback": "one grammar backend (llguidance), nothing to fall to",
    "messages[].refusal": "an earlier refusal, kept out of the prompt",
    "best_of": "accepted when it equals n (or is null); more is a 400",
}


class RemovedGuidedFields(msgspec.Struct, kw_only=True):
    """vLLM's removed guided_* fields: null is accepted, anything else a 400 naming the
    replacement (structured_request.REMOVED_GUIDED_FIELDS)."""

    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_json_object: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None


class BaseRequest(RemovedGuidedFields, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    n: Int64 | None = None  # null: 1
    stream: bool | None = None
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
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None  # null: true
    logit_bias: dict[str, Float] | None = None  # OpenAI: token id (as a string) -> bias
    user: str | None = None  # no-op (ACCEPTED_NO_OPS)
    # vLLM's: logprobs name tokens "token_id:N", so a client (stoker eval) gets exact ids.
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: each prompt token's logprob and its top k (prompt_logprob_render.py).
    prompt_logprobs: Int64 | None = None
    # The output's constraint (structured_request.py): OpenAI's spelling, or vLLM's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None


class CompletionRequest(BaseRequest):
    prompt: Any  # str | list[int] | [str] | [list[int]]: msgspec unions allow one array type
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool | None = None  # the prompt leads the text and logprobs (prompt_logprob_render.py)
    best_of: Int64 | None = None  # n, or null: no-op; more: 400 (no server-side ranking)
    suffix: str | None = None  # a non-empty suffix: 400 (no insertion)


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["content"]
    content: str | list[ContentPart]


class ChatRequest(BaseRequest):
    messages: list[ChatMessageIn]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool | None = None  # null: true (vLLM's)
    continue_final_message: bool | None = None  # vLLM's: extend the last assistant message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None  # deprecated: mapped onto tools
    function_call: FunctionCallChoice | None = None  # deprecated: mapped onto tool_choice
    # No-ops (ACCEPTED_NO_OPS).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    reasoning_effort: str | None = None
    prediction: Prediction | None = None
    modalities: list[Literal["text", "audio"]] | None = None  # "audio": 400
    # Asks for what stoker cannot do: a 400 when set.
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None


# /tokenize and /detokenize, in vLLM's shapes. A body with `messages` is a chat request.
class TokenizeCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    messages: list[ChatMessageIn]
    # As on /v1/chat/completions (vLLM's /tokenize takes them too): the ids a request gets.
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes the special tokens
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


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
