"""Llama 3.1 / 3.2 / 3.3 JSON calls. Meta's templates ask for custom tools to be answered as
a bare JSON object, `{"name": function name, "parameters": dictionary of argument name and its
value}`, and write past calls the same way; the model may prefix it with <|python_tag|> (a
special token, so usually gone by detokenization) and separate several calls with ";"
(https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/).

A bare "{" opens a call only at the start of the output or right after a call; elsewhere a
brace is content.
"""

from __future__ import annotations

import json

from stoker.common.tool_calls.blocks import (
    FAIL,
    Cache,
    Found,
    Miss,
    call_from_object,
    skip_ws,
    value,
)
from stoker.common.tool_calls.format import TokenTerm, ToolFormat, lark_literal

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    bare_object = True
    separator = ";"
    example = '{"name": <tool-name>, "parameters": <arguments-json-object>}'

    def block(self, text: str, at: int, marker_len: int, cache: Cache) -> Found | Miss:
        start = skip_ws(text, at + marker_len)
        end = value(text, start, at, cache, opens="{")
        if isinstance(end, Miss):
            return end
        call = call_from_object(text, start, end, ARGUMENT_KEYS)
        return FAIL if call is None else (end, [call])

    @staticmethod
    def _call_head(name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f"{self._call_head(name)}{arguments}}}" for name, arguments in calls)

    def lark_call(self, name: str, args_rule: str, token: TokenTerm) -> str:
        return f'{lark_literal(self._call_head(name))} {args_rule} "}}"'

    def lark_calls(self, call_rule: str, parallel: bool, token: TokenTerm) -> str:
        return f'{call_rule} ("; " {call_rule})*' if parallel else call_rule
