"""Where JSON values start and end in model output, so a call's arguments are the exact bytes
the model wrote (OpenAI's `arguments` is JSON text; re-serialising would change spacing, key
order and number spelling)."""

from __future__ import annotations

import json

_WS = " \t\r\n"  # JSON's insignificant whitespace (RFC 8259, section 2)


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


class ValueEnd:
    """Finds the end of one JSON object or array, resuming where the last call stopped, so a
    streamed call is scanned once however many chunks it arrives in. It only tracks strings,
    escapes and nesting; `loads_strict` decides whether the span is valid JSON."""

    __slots__ = ("_done", "_depth", "_in_string", "_escaped", "_end")

    def __init__(self) -> None:
        self._end: int | None = None  # the value's length, once closed
        self._done = 0  # characters of the value scanned so far
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, start: int) -> int | None:
        """The end (exclusive) of the value that opens at text[start], or None if it is still
        open at the end of text."""
        if self._end is not None:
            return start + self._end
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        pos = start + self._done
        end = None
        while pos < len(text):
            c = text[pos]
            pos += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    end = pos
                    self._end = pos - start
                    break
        self._done, self._depth, self._in_string, self._escaped = (
            pos - start,
            depth,
            in_string,
            escaped,
        )
        return end


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> object:
    """json.loads without Python's NaN / Infinity extensions, which clients' parsers reject.
    Raises ValueError."""
    return json.loads(text, parse_constant=_no_constants)


_DECODER = json.JSONDecoder()


def member_spans(text: str, start: int) -> dict[str, tuple[int, int]]:
    """The span of each top-level member's value in the valid JSON object at text[start]
    (a repeated key keeps its last span, as json.loads keeps its last value)."""
    spans: dict[str, tuple[int, int]] = {}
    pos = skip_ws(text, start + 1)
    while text[pos] != "}":
        key, pos = _DECODER.raw_decode(text, pos)
        pos = skip_ws(text, skip_ws(text, pos) + 1)  # past the ':'
        _, end = _DECODER.raw_decode(text, pos)
        spans[key] = (pos, end)
        pos = skip_ws(text, end)
        if text[pos] == ",":
            pos = skip_ws(text, pos + 1)
    return spans


def element_spans(text: str, start: int) -> list[tuple[int, int]]:
    """The span of each element of the valid JSON array at text[start]."""
    spans: list[tuple[int, int]] = []
    pos = skip_ws(text, start + 1)
    while text[pos] != "]":
        _, end = _DECODER.raw_decode(text, pos)
        spans.append((pos, end))
        pos = skip_ws(text, end)
        if text[pos] == ",":
            pos = skip_ws(text, pos + 1)
    return spans
