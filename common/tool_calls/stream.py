"""The one reader of model output for every format: parse() runs it over the whole text, the
api feeds it chunk by chunk. Content is released as soon as it is decided; text that could
still open a call (a marker's first characters, a call block not yet closed) is held back.

What counts as content: everything that is not a call, except whitespace next to a call (the
newlines between Hermes blocks, the "; " between Llama calls), so an output of calls alone has
no content. A would-be call that never becomes valid JSON of the right shape (cut by
max_tokens, or garbage) is content, marker included, and reading resumes after its marker.
Each call is emitted whole, in one ToolCallDelta, when its block closes: arguments cannot be
streamed earlier without risking a call that later turns out to be content.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stoker.common.tool_calls.blocks import MORE, Cache, Miss, skip_ws
from stoker.common.tool_calls.types import ContentDelta, Delta, ToolCallDelta, call_id

if TYPE_CHECKING:
    from stoker.common.tool_calls.format import ToolFormat

_CONTENT, _START, _AFTER_CALL, _AFTER_SEPARATOR = range(4)


class StreamParser:
    def __init__(self, fmt: ToolFormat, call_id_seed: str) -> None:
        self._fmt = fmt
        self._seed = call_id_seed
        self._buf = ""  # text not yet decided; a pending block starts within it
        self._state = _START if fmt.bare_object else _CONTENT
        self._calls = 0
        self._cache: Cache = {}
        self._longest_marker = max(len(m) for m in fmt.markers)

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        """End of output: what is still held back is decided (an open call block is content)."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        buf, i = self._buf, 0
        while i < len(buf):
            if self._state in (_AFTER_CALL, _AFTER_SEPARATOR):
                # Whitespace next to a call is not content; one separator may sit between calls.
                i = skip_ws(buf, i)
                if i == len(buf):
                    break
                sep = self._fmt.separator
                if self._state == _AFTER_CALL and sep and buf.startswith(sep, i):
                    i, self._state = i + len(sep), _AFTER_SEPARATOR
                else:
                    self._state = _START if self._fmt.bare_object else _CONTENT
                continue
            if self._state == _START:
                # A bare object may open a call here; the whitespace before it is held.
                j = skip_ws(buf, i)
                if j == len(buf) and not final:
                    break
                if j < len(buf) and buf[j] == "{":
                    step = self._try_block(buf, i, j, 0, final, out)
                    if step is None:
                        break
                    i = step
                    continue
                self._state = _CONTENT
                continue
            # _CONTENT: up to the next marker, holding back what could start one.
            at, marker = self._next_marker(buf, i)
            if marker is None:
                end = len(buf) if final else at
                held = end if final else len(buf[i:end].rstrip(" \t\r\n")) + i
                _content(out, buf[i:held])
                i = held
                break
            held = len(buf[i:at].rstrip(" \t\r\n")) + i
            _content(out, buf[i:held])
            i = held
            step = self._try_block(buf, i, at, len(marker), final, out)
            if step is None:
                break
            i = step
        self._buf = buf[i:]
        return _merged(out)

    def _next_marker(self, buf: str, i: int) -> tuple[int, str | None]:
        """The first marker at or after i; else (where a possible marker prefix starts, None)."""
        hits = [(at, m) for m in self._fmt.markers if (at := buf.find(m, i)) >= 0]
        if hits:
            return min(hits)
        for size in range(min(self._longest_marker - 1, len(buf) - i), 0, -1):
            if any(m.startswith(buf[len(buf) - size :]) for m in self._fmt.markers):
                return len(buf) - size, None
        return len(buf), None

    def _try_block(
        self, buf: str, held: int, at: int, marker_len: int, final: bool, out: list[Delta]
    ) -> int | None:
        """Read the block whose trigger is at `at` (whitespace from `held` is held with it).
        Returns where reading goes on, or None to wait for more text."""
        found = self._fmt.block(buf, at, marker_len, self._cache)
        if found is MORE and not final:
            return None
        self._cache.clear()
        if isinstance(found, Miss):  # MORE at the end, or FAIL
            end = at + max(marker_len, 1)  # the marker (or the bare "{") is content
            _content(out, buf[held:end])
            self._state = _CONTENT
            return end
        end, calls = found
        for name, arguments in calls:
            out.append(
                ToolCallDelta(self._calls, call_id(self._seed, self._calls), name, arguments)
            )
            self._calls += 1
        self._state = _AFTER_CALL
        return end


def _content(out: list[Delta], text: str) -> None:
    if text:
        out.append(ContentDelta(text))


def _merged(out: list[Delta]) -> list[Delta]:
    """Adjacent content pieces as one delta."""
    merged: list[Delta] = []
    for d in out:
        if isinstance(d, ContentDelta) and merged and isinstance(merged[-1], ContentDelta):
            merged[-1] = ContentDelta(merged[-1].text + d.text)
        else:
            merged.append(d)
    return merged
