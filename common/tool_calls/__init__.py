"""Tool calling's formats, sans IO: which format a model speaks (detect_format), the messages
its chat template should see (prepare_messages), the grammar that forces calls (tool_grammar),
and the reader of its output, whole (ToolFormat.parse) or streamed (ToolFormat.stream_parser).
"""

from stoker.common.tool_calls.detect import (
    FORMAT_NAMES,
    detect_format,
    template_renders_tools,
    template_shows_any_role,
)
from stoker.common.tool_calls.format import ToolFormat
from stoker.common.tool_calls.grammar import tool_grammar
from stoker.common.tool_calls.messages import prepare_messages, tools_system_prompt
from stoker.common.tool_calls.stream import StreamParser
from stoker.common.tool_calls.types import ContentDelta, Delta, ToolCall, ToolCallDelta, call_id

__all__ = [
    "FORMAT_NAMES",
    "ContentDelta",
    "Delta",
    "StreamParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolFormat",
    "call_id",
    "detect_format",
    "prepare_messages",
    "template_renders_tools",
    "template_shows_any_role",
    "tool_grammar",
    "tools_system_prompt",
]
