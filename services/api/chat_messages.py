"""OpenAI chat messages -> `ChatMessage`s, as the chat template sees them.

The message objects stay lenient about keys they do not name: clients append the assistant
message of a response to the conversation as they got it (`message.model_dump()`), which carries
keys of the server that answered (`annotations`, vLLM's `reasoning_content`). Those are dropped;
every key that asks for something stoker cannot do is a 400.
"""

from __future__ import annotations

from typing import Any

import msgspec

from stoker.common.messages import ChatMessage
from stoker.services.api.errors import ApiError

# developer is OpenAI's newer name for system; a template knows only system. function is the
# deprecated tool role (`functions`), rendered as a tool result. Other roles reach the template
# as they are (Llama 3.1's templates know `ipython`), as vLLM's custom-role messages do.
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}


class ContentPart(msgspec.Struct):  # lenient: parts gain optional keys (prompt_cache_breakpoint)
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part: rendered as its text


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(msgspec.Struct):
    id: str
    type: str = "function"
    function: FunctionCallIn | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # required for role tool: the call this result answers
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    function_call: FunctionCallIn | None = None  # deprecated: an assistant's one call
    refusal: str | None = None  # no-op: an earlier refusal, kept out of the prompt
    audio: dict[str, Any] | None = None  # an earlier audio answer: 400, stoker is text only


def chat_messages(given: list[ChatMessageIn]) -> list[ChatMessage]:
    """Messages as the chat template sees them: text parts joined, no content as ""."""
    if not given:
        raise ApiError("messages must not be empty", param="messages")
    out: list[ChatMessage] = []
    last_function_call_id: str | None = None
    for i, m in enumerate(given):
        role = ROLES.get(m.role, m.role)
        if m.audio is not None:
            raise ApiError(
                f"messages[{i}].audio: audio is not supported (text only)", param="messages"
            )
        message = ChatMessage(role, _content(i, m.content), name=m.name)
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(
                    f"messages[{i}]: a tool message needs tool_call_id", param="messages"
                )
            message.tool_call_id = m.tool_call_id
        elif m.role == "function":  # answers the latest deprecated function_call
            message.tool_call_id = last_function_call_id
        elif m.role == "assistant":
            calls = _tool_calls(i, m)
            if m.function_call is not None:
                last_function_call_id = f"call_{i}"
            message.tool_calls = msgspec.json.encode(calls).decode() if calls else None
        elif m.tool_calls or m.function_call is not None:
            raise ApiError(f"messages[{i}]: only assistant messages make calls", param="messages")
        out.append(message)
    return out


def _content(i: int, content: str | list[ContentPart] | None) -> str:
    if not isinstance(content, list):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        text = (
            part.text if part.type == "text" else part.refusal if part.type == "refusal" else None
        )
        if text is None:
            raise ApiError(
                f"messages[{i}].content[{j}] is of type {part.type!r}: only text content parts "
                "are supported (this server takes text only)",
                param="messages",
            )
        texts.append(text)
    return "".join(texts)


def _tool_calls(i: int, m: ChatMessageIn) -> list[dict[str, Any]]:
    """An assistant's calls in OpenAI's shape; a deprecated function_call becomes one."""
    if m.tool_calls and m.function_call is not None:
        raise ApiError(
            f"messages[{i}] has both tool_calls and function_call; send tool_calls",
            param="messages",
        )
    calls = []
    for j, call in enumerate(m.tool_calls or []):
        if call.type != "function" or call.function is None:
            raise ApiError(
                f"messages[{i}].tool_calls[{j}]: only function calls are supported",
                param="messages",
            )
        calls.append(_call(call.id, call.function))
    if m.function_call is not None:
        calls.append(_call(f"call_{i}", m.function_call))
    return calls


def _call(call_id: str, function: FunctionCallIn) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function.name, "arguments": function.arguments},
    }
