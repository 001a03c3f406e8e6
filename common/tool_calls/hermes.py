"""Hermes-style calls (Hermes 2 Pro, Qwen2.5, Qwen3), and the generic format built on them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, any text before them being content. The generic format, for templates with
no tool syntax of their own, writes the same blocks on one line,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and is taught by the system prompt
prepare_messages adds (messages.py). Both read either spelling.
"""

from __future__ import annotations

import json

from stoker.common.tool_calls.blocks import (
    FAIL,
    Cache,
    Found,
    Miss,
    call_from_object,
    literal,
    skip_ws,
    value,
)
from stoker.common.tool_calls.format import TokenTerm, ToolFormat, lark_literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # some fine-tunes write Llama's key


class HermesFormat(ToolFormat):
    name = "hermes"
    markers = (OPEN,)
    newline = "\n"  # inside the tags, as Qwen2.5's template writes past calls
    example = f'{OPEN}\n{{"name": <tool-name>, "arguments": <arguments-json-object>}}\n{CLOSE}'

    def block(self, text: str, at: int, marker_len: int, cache: Cache) -> Found | Miss:
        start = skip_ws(text, at + marker_len)
        end = value(text, start, at, cache, opens="{")
        if isinstance(end, Miss):
            return end
        call = call_from_object(text, start, end, ARGUMENT_KEYS)
        if call is None:
            return FAIL
        close = literal(text, skip_ws(text, end), CLOSE)
        return close if isinstance(close, Miss) else (close, [call])

    def _call_head(self, name: str) -> str:
        return f'{self.newline}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(
            f"{OPEN}{self._call_head(name)}{arguments}}}{self.newline}{CLOSE}"
            for name, arguments in calls
        )

    def lark_call(self, name: str, args_rule: str, token: TokenTerm) -> str:
        head, tail = lark_literal(self._call_head(name)), lark_literal("}" + self.newline)
        return f"{token(OPEN)} {head} {args_rule} {tail} {token(CLOSE)}"

    def lark_calls(self, call_rule: str, parallel: bool, token: TokenTerm) -> str:
        return f'{call_rule} ("\\n" {call_rule})*' if parallel else call_rule


class GenericFormat(HermesFormat):
    name = "generic"
    newline = ""
    example = f'{OPEN}{{"name": <tool-name>, "arguments": <arguments-json-object>}}{CLOSE}'
