"""What a tool-call format is: how calls look in model output (read by StreamParser), how
they are written back into a prompt, and the Lark grammar that forces them (grammar.py)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable

from stoker.common.tool_calls.blocks import Cache, Found, Miss
from stoker.common.tool_calls.stream import StreamParser
from stoker.common.tool_calls.types import ContentDelta, ToolCall, ToolCallDelta

# Maps a marker to its grammar term: `<[id]>` for a special token, else a string literal.
TokenTerm = Callable[[str], str]


def lark_literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


class ToolFormat(ABC):
    name: str
    keeps_special_tokens: bool = False  # markers are special tokens: detokenize keeping them
    markers: tuple[str, ...]  # text that opens a call block anywhere in the output
    bare_object: bool = False  # a bare "{" opens one at the start and right after a call
    separator: str = ""  # may sit between calls; like whitespace there, it is not content
    example: str  # one call, with placeholders, for the tools system prompt

    @abstractmethod
    def block(self, text: str, at: int, marker_len: int, cache: Cache) -> Found | Miss:
        """Read the call block whose trigger (a marker, or a bare "{" with marker_len 0) is at
        text[at]; see blocks.py."""

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments text) pairs as the model writes them: the canonical output, which
        the grammar accepts and parse() reads back."""

    @abstractmethod
    def lark_call(self, name: str, args_rule: str, token: TokenTerm) -> str:
        """The body of a Lark rule for one call of `name`, its arguments matching args_rule."""

    @abstractmethod
    def lark_calls(self, call_rule: str, parallel: bool, token: TokenTerm) -> str:
        """The body of the start rule: one call_rule, or with parallel one or more."""

    def stream_parser(self, call_id_seed: str) -> StreamParser:
        return StreamParser(self, call_id_seed)

    def parse(self, text: str, call_id_seed: str) -> tuple[str | None, list[ToolCall]]:
        """(content, or None when empty; calls) of a whole output."""
        parser = self.stream_parser(call_id_seed)
        deltas = parser.feed(text) + parser.finish()
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        calls = [
            ToolCall(d.id or "", d.name or "", d.arguments)
            for d in deltas
            if isinstance(d, ToolCallDelta)
        ]
        return content or None, calls

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"
