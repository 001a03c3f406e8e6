"""A chat request's messages and tools as the chat template sees them (docs/tool-calling.md).

Without tools or tool messages a message is {"role", "content"}, as always. With them the
format's prepare_messages (common/tool_calls) shapes the conversation: calls' arguments as
objects for templates that expect them, and, for templates with no tool syntax, the tools and
the calling convention in the system message.
"""

from __future__ import annotations

import json
from typing import Any

from stoker.common.messages import ChatMessage, TokenizeRequest
from stoker.common.tool_calls import (
    detect_format,
    prepare_messages,
    template_renders_tools,
    template_shows_any_role,
)


def message_dict(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls is not None:
        out["tool_calls"] = json.loads(m.tool_calls)
    return out


def template_messages(
    tokenizer: Any, req: TokenizeRequest
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template) for a request; see template_inputs."""
    assert req.messages is not None
    return template_inputs(tokenizer, req.messages, req.tools, req.tool_format)


def template_inputs(
    tokenizer: Any, given: list[ChatMessage], tools_json: str | None, tool_format: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template); tools is None where the template can't render them
    (the messages then carry them). The tokenizer processes and the api's /tokenize share it,
    so /tokenize shows what a request gets."""
    messages = [message_dict(m) for m in given]
    tools = json.loads(tools_json) if tools_json else None
    uses_tools = tools or any(m.tool_calls or m.tool_call_id for m in given)
    if not uses_tools:
        return messages, None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool one where there is one
        template = template.get("tool_use") or template.get("default")
    fmt = detect_format(template, tool_format or None)
    renders = template_renders_tools(template)
    tool_role = template_shows_any_role(template)
    messages = prepare_messages(fmt, messages, tools, renders, tool_role=tool_role)
    return messages, tools if renders else None
