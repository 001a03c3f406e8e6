"""The pieces a format's call block is read with. A block reader looks at the text from a
trigger (a marker such as "<tool_call>", or a bare "{") and answers MORE (the text so far could
still become a call: wait), FAIL (it cannot: the trigger is content) or where the block ends
and the calls in it. Each answer depends only on the text, never on how it was chunked."""

from __future__ import annotations

import enum

from stoker.common.tool_calls.json_spans import ValueEnd, loads_strict, member_spans, skip_ws


class Miss(enum.Enum):
    MORE = "more"
    FAIL = "fail"


MORE, FAIL = Miss.MORE, Miss.FAIL
Found = tuple[int, list[tuple[str, str]]]  # (end of the block, [(name, arguments)])
Cache = dict[int, ValueEnd]  # a pending block's value scanners, by offset from its trigger


def literal(text: str, pos: int, word: str) -> int | Miss:
    """The position after `word` at text[pos], MORE if text ends inside it, else FAIL."""
    if text.startswith(word, pos):
        return pos + len(word)
    return MORE if word.startswith(text[pos:]) else FAIL


def value(text: str, pos: int, trigger: int, cache: Cache, opens: str = "{[") -> int | Miss:
    """The end of the JSON object or array that opens at text[pos] (with one of `opens`); the
    cache, keyed by the offset from the block's trigger, scans a chunked block once."""
    if pos >= len(text):
        return MORE
    if text[pos] not in opens:
        return FAIL
    end = cache.setdefault(pos - trigger, ValueEnd()).scan(text, pos)
    return MORE if end is None else end


def json_object(text: str, start: int, end: int) -> dict | None:
    """The object at text[start:end] if it is valid JSON and an object."""
    try:
        obj = loads_strict(text[start:end])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def call_from_object(
    text: str, start: int, end: int, keys: tuple[str, ...]
) -> tuple[str, str] | None:
    """(name, arguments text) from a {"name": ..., <key>: {...}} object at text[start:end],
    the first of `keys` present naming the arguments; None if it is not such an object."""
    obj = json_object(text, start, end)
    if obj is None or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None or not isinstance(obj[key], dict):
        return None
    a, b = member_spans(text, start)[key]
    return obj["name"], text[a:b]


__all__ = ["FAIL", "MORE", "Cache", "Found", "Miss", "call_from_object", "json_object"]
__all__ += ["literal", "skip_ws", "value"]
