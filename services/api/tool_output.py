"""A chat choice's tool calls, parsed out of its text by the model's format (common/tool_calls)
and rendered in OpenAI's shapes: a whole message, or stream deltas.

Each choice has its own stream parser (the n choices of a call stream interleaved). The format
guarantees that a stream's deltas add up to parse()'s result, so a streamed choice adds up to
the whole response for the same output. The call ids derive from the sub-request's id, so a
stream and parse() of the same choice agree on them too.
"""

from __future__ import annotations

from typing import Any

from stoker.common.tool_calls import (
    ContentDelta,
    Delta,
    StreamParser,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
)


class ToolOutput:
    """Tool calls for one API call's choices."""

    def __init__(self, fmt: ToolFormat, req_id: str, parallel: bool, legacy: bool) -> None:
        self.fmt, self.req_id = fmt, req_id
        self.parallel = parallel  # false: at most one call per choice (as vLLM, the first)
        self.legacy = legacy  # the request used `functions`: answer with function_call
        self._streams: dict[int, _Stream] = {}

    def message(
        self, index: int, text: str, finish: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, the finish_reason) of a whole choice."""
        content, calls = self.fmt.parse(text, f"{self.req_id}-{index}")
        if not self.parallel:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls and self.legacy:
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            message["tool_calls"] = [_call(c) for c in calls]
        return message, self._finish(finish, bool(calls))

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """(the chat delta, the finish_reason) for a streamed choice's next text; the parser
        holds back what could still open a call until it is decided."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = _Stream(
                self.fmt.stream_parser(f"{self.req_id}-{index}")
            )
        items = stream.parser.feed(text) if text else []
        if finish is not None:
            items += stream.parser.finish()
        delta = stream.render(items, self.parallel, self.legacy)
        return delta, None if finish is None else self._finish(finish, stream.num_calls > 0)

    def _finish(self, finish: str | None, made_calls: bool) -> str | None:
        if finish == "stop" and made_calls:  # "length" stays: the client must see the cut
            return "function_call" if self.legacy else "tool_calls"
        return finish


class _Stream:
    def __init__(self, parser: StreamParser) -> None:
        self.parser = parser
        self.num_calls = 0

    def render(self, items: list[Delta], parallel: bool, legacy: bool) -> dict[str, Any]:
        """OpenAI's delta: content text, then the calls (a call's first entry carries its id
        and name, later ones only arguments), entries of one call merged."""
        content = "".join(d.text for d in items if isinstance(d, ContentDelta))
        calls: list[dict[str, Any]] = []
        for d in items:
            if not isinstance(d, ToolCallDelta) or (d.index > 0 and not parallel):
                continue
            self.num_calls = max(self.num_calls, d.index + 1)
            if calls and calls[-1]["index"] == d.index and d.id is None:
                calls[-1]["function"]["arguments"] += d.arguments
            elif d.id is not None:
                function = {"name": d.name, "arguments": d.arguments}
                calls.append(
                    {"index": d.index, "id": d.id, "type": "function", "function": function}
                )
            elif d.arguments:
                calls.append({"index": d.index, "function": {"arguments": d.arguments}})
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls and legacy:  # one call (parallel is off): its name first, then arguments
            delta["function_call"] = calls[0]["function"]
        elif calls:
            delta["tool_calls"] = calls
        return delta


def _call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
