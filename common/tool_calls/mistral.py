"""Mistral calls, after the [TOOL_CALLS] control token (so the api must detokenize keeping
special tokens). Two generations of templates:

- v3 (Mistral 7B v0.3, Mixtral 8x22B, Nemo): a JSON list,
  `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` (Nemo's template has no space before
  the list); all of its items are calls or the whole list is content.
- v11+ (Mistral Small 3.1+, Devstral, Magistral), whose templates write [ARGS]:
  `[TOOL_CALLS]f[ARGS]{...}`, one marker per call.

The reader accepts either; the grammar and the rendering follow the template's generation.
"""

from __future__ import annotations

import json
import re

from stoker.common.tool_calls.blocks import (
    FAIL,
    MORE,
    Cache,
    Found,
    Miss,
    call_from_object,
    json_object,
    literal,
    skip_ws,
    value,
)
from stoker.common.tool_calls.format import TokenTerm, ToolFormat, lark_literal
from stoker.common.tool_calls.json_spans import element_spans, loads_strict

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")  # OpenAI's function-name characters, and "."


class MistralFormat(ToolFormat):
    name = "mistral"
    keeps_special_tokens = True
    markers = (TOOL_CALLS,)

    def __init__(self, args_marker: bool = False, list_open: str = " [") -> None:
        self.args_marker = args_marker  # v11+: name[ARGS]{...}
        self.list_open = list_open  # v3: what follows [TOOL_CALLS], as the template writes it
        if args_marker:
            self.example = f"{TOOL_CALLS}<tool-name>{ARGS}<arguments-json-object>"
        else:
            call = '{"name": <tool-name>, "arguments": <arguments-json-object>}'
            self.example = f"{TOOL_CALLS}{list_open}{call}]"

    def block(self, text: str, at: int, marker_len: int, cache: Cache) -> Found | Miss:
        start = skip_ws(text, at + marker_len)
        if start == len(text):
            return MORE
        if text[start] in "[{":
            return self._json_calls(text, start, at, cache)
        name_end = _NAME.match(text, start).end()  # type: ignore[union-attr]
        if name_end == len(text):
            return MORE
        args = literal(text, name_end, ARGS) if name_end > start else FAIL
        if isinstance(args, Miss):
            return args
        args = skip_ws(text, args)
        end = value(text, args, at, cache, opens="{")
        if isinstance(end, Miss):
            return end
        if json_object(text, args, end) is None:
            return FAIL
        return end, [(text[start:name_end], text[args:end])]

    @staticmethod
    def _json_calls(text: str, start: int, at: int, cache: Cache) -> Found | Miss:
        end = value(text, start, at, cache)
        if isinstance(end, Miss):
            return end
        if text[start] == "{":
            call = call_from_object(text, start, end, ("arguments",))
            return FAIL if call is None else (end, [call])
        try:
            loads_strict(text[start:end])
        except ValueError:
            return FAIL
        calls = [
            call_from_object(text, a, b, ("arguments",)) for a, b in element_spans(text, start)
        ]
        if not calls or None in calls:
            return FAIL
        return end, calls  # type: ignore[return-value]

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        if self.args_marker:
            return "".join(f"{TOOL_CALLS}{name}{ARGS}{arguments}" for name, arguments in calls)
        items = (f"{_head(name)}{arguments}}}" for name, arguments in calls)
        return f"{TOOL_CALLS}{self.list_open}{', '.join(items)}]"

    def lark_call(self, name: str, args_rule: str, token: TokenTerm) -> str:
        if self.args_marker:
            return f"{token(TOOL_CALLS)} {lark_literal(name)} {token(ARGS)} {args_rule}"
        return f'{lark_literal(_head(name))} {args_rule} "}}"'

    def lark_calls(self, call_rule: str, parallel: bool, token: TokenTerm) -> str:
        if self.args_marker:
            return f"{call_rule}+" if parallel else call_rule
        more = f' (", " {call_rule})*' if parallel else ""
        return f'{token(TOOL_CALLS)} {lark_literal(self.list_open)} {call_rule}{more} "]"'


def _head(name: str) -> str:
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
