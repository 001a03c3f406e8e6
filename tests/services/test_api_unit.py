"""Api pieces without processes: SSE coalescing, n-way accumulation, tool calls in whole and
streamed chat responses, /health rules."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from stoker.common.addresses import Addresses
from stoker.common.messages import SchedulerStats, TextDelta, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.common.tool_calls import detect_format
from stoker.common.wire_digest import PROTOCOL
from stoker.services.api.app import Api
from stoker.services.api.delta_queue import DeltaQueue
from stoker.services.api.engine_client import EngineClient, _Tokenizer
from stoker.services.api.generation import Generation
from stoker.services.api.responses import Accumulator, Formatter
from stoker.services.api.tokens import TokenStrings
from stoker.services.api.tool_output import ToolOutput


def _events(model_path, first: TextDelta, queued: list[TextDelta], n: int = 1) -> list[dict]:
    async def run() -> list[bytes]:
        queue = DeltaQueue()
        for d in queued:
            queue.put_nowait(d)
        fmt = Formatter("completion", "cmpl-x", "m", TokenStrings(model_path), logprobs=False)
        gen = Generation("completion", None, SamplingParams(), n, True, True, prompt="p")
        return [e async for e in Api._events(first, queue, Accumulator("cmpl-x", n), fmt, gen)]

    raw = asyncio.run(run())
    assert raw[-1] == b"data: [DONE]\n\n"
    return [msgspec.json.decode(e[len(b"data: ") :]) for e in raw[:-1]]


def test_backlog_is_coalesced_into_one_event(model_path):
    first = TextDelta("cmpl-x-0", "a", pack_ids([10]), num_prompt_tokens=3)
    backlog = [TextDelta("cmpl-x-0", c, pack_ids([10])) for c in "bcde"]
    backlog.append(TextDelta("cmpl-x-0", "f", pack_ids([10]), finish_reason="length"))
    events = _events(model_path, first, backlog)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "bcdef"]
    assert events[1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert events[-1]["usage"]["prompt_tokens"] == 3


def test_n_choices_are_separate_events(model_path):
    first = TextDelta("cmpl-x-1", "x", pack_ids([10]), num_prompt_tokens=2)
    backlog = [
        TextDelta("cmpl-x-0", "y", pack_ids([11]), finish_reason="stop"),
        TextDelta("cmpl-x-1", "z", pack_ids([12]), finish_reason="length"),
    ]
    events = _events(model_path, first, backlog, n=2)
    texts = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "y", 1: "xz"}
    assert events[-1]["usage"]["completion_tokens"] == 3


# -- tool calls -------------------------------------------------------------------------------

CALLS = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
ONLY_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def _tool_formatter(model_path, parallel: bool = True, legacy: bool = False):
    tools = ToolOutput(detect_format("<tool_call>"), "chatcmpl-x", parallel, legacy)
    return Formatter("chat", "chatcmpl-x", "m", TokenStrings(model_path), False, tools)


def _deltas(texts: list[str], finishes: list[str], step: int) -> list[TextDelta]:
    """Each choice's text in pieces of `step` characters, the choices interleaved."""
    out = []
    pieces = [[t[i : i + step] for i in range(0, len(t), step)] for t in texts]
    for k in range(max(len(p) for p in pieces)):
        for i, p in enumerate(pieces):
            if k < len(p):
                last = k == len(p) - 1
                out.append(
                    TextDelta(
                        f"chatcmpl-x-{i}",
                        p[k],
                        pack_ids([10]),
                        finish_reason=finishes[i] if last else None,
                        num_prompt_tokens=3,
                    )
                )
    return out


def _whole(model_path, texts, finishes, **kw) -> ChatCompletion:
    acc = Accumulator("chatcmpl-x", len(texts))
    for d in _deltas(texts, finishes, step=1000):
        acc.add(d)
    body = _tool_formatter(model_path, **kw).response(acc)
    return ChatCompletion.model_validate(body)


def _streamed(model_path, texts, finishes, step: int, **kw) -> tuple[ChatCompletion, list[dict]]:
    """The stream's events, and what the openai client's own accumulator makes of them."""
    n = len(texts)
    deltas = _deltas(texts, finishes, step)

    async def run() -> list[bytes]:
        queue = DeltaQueue()
        for d in deltas[1:]:
            queue.put_nowait(d)
        fmt = _tool_formatter(model_path, **kw)
        gen = Generation("chat", None, SamplingParams(), n, True, True, messages=[])
        acc = Accumulator("chatcmpl-x", n, whole=False)
        return [e async for e in Api._events(deltas[0], queue, acc, fmt, gen)]

    raw = asyncio.run(run())
    assert raw[-1] == b"data: [DONE]\n\n"
    events = [msgspec.json.decode(e[len(b"data: ") :]) for e in raw[:-1]]
    state = ChatCompletionStreamState()
    for e in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(e))
    return state.get_final_completion(), events


def _choices(completion: ChatCompletion) -> list[tuple]:
    return [
        (
            c.message.content,
            [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
            c.finish_reason,
        )
        for c in completion.choices
    ]


def test_whole_response_renders_tool_calls(model_path):
    out = _whole(model_path, [CALLS, ONLY_CALL, CALLS], ["stop", "stop", "length"])
    (content, calls, finish), (content1, calls1, finish1), (_, _, finish2) = _choices(out)
    assert content == "Let me check." and finish == "tool_calls"
    assert [(name, args) for _, name, args in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)
    assert content1 is None and finish1 == "tool_calls" and len(calls1) == 1
    assert finish2 == "length"  # a cut stays visible as a cut


@pytest.mark.parametrize("step", [1, 3, 17, 1000])
def test_streamed_tool_calls_add_up_to_the_whole_response(model_path, step):
    texts, finishes = [CALLS, ONLY_CALL], ["stop", "stop"]
    streamed, events = _streamed(model_path, texts, finishes, step)
    assert _choices(streamed) == _choices(_whole(model_path, texts, finishes))
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    first = [
        tc
        for e in events
        for c in e["choices"]
        for tc in c["delta"].get("tool_calls", [])
        if "id" in tc
    ]
    assert all(tc["type"] == "function" and tc["function"]["name"] for tc in first)
    assert len(first) == 3  # one opening delta per call


def test_plain_text_with_tools_streams_as_content(model_path):
    texts, finishes = ["Just text, no calls."], ["stop"]
    streamed, _ = _streamed(model_path, texts, finishes, step=2)
    assert _choices(streamed) == [("Just text, no calls.", [], "stop")]
    assert _choices(streamed) == _choices(_whole(model_path, texts, finishes))


def test_parallel_off_keeps_the_first_call(model_path):
    whole = _whole(model_path, [CALLS], ["stop"], parallel=False)
    streamed, _ = _streamed(model_path, [CALLS], ["stop"], step=5, parallel=False)
    assert [name for _, name, _ in _choices(whole)[0][1]] == ["get_weather"]
    assert _choices(streamed) == _choices(whole)


def test_functions_answer_with_function_call(model_path):
    whole = _whole(model_path, [ONLY_CALL], ["stop"], legacy=True)
    message = whole.choices[0].message
    assert message.function_call.name == "get_time" and not message.tool_calls
    assert message.function_call.arguments == '{"tz": "CET"}'
    assert whole.choices[0].finish_reason == "function_call"
    _, events = _streamed(model_path, [ONLY_CALL], ["stop"], step=4, legacy=True)
    calls = [c["delta"]["function_call"] for e in events for c in e["choices"]
             if "function_call" in c["delta"]]  # fmt: skip
    assert calls[0]["name"] == "get_time"
    assert "".join(c["arguments"] for c in calls) == '{"tz": "CET"}'


def _stats(ready: bool = True) -> SchedulerStats:
    return SchedulerStats(ready, 0, 0, 10, 10, 0.0, 0, 0, 0, 512, "m", protocol=PROTOCOL)


def test_health_rules(tmp_path):
    client = EngineClient(Addresses.in_run_dir(tmp_path), num_tokenizers=2)
    now = time.monotonic()
    assert not client.health()[0]  # nothing heard yet
    client.tokenizers["tok-0"] = _Tokenizer(1, 0, now)
    client._on_stats(_stats())
    assert not client.health()[0]  # 1 of 2 tokenizers
    client.tokenizers["tok-1"] = _Tokenizer(2, 0, now)
    assert client.health() == (True, "ok")
    client.tokenizers["tok-1"].last_seen = now - 5
    assert "tok-1" in client.health()[1]  # a silent tokenizer
    client.tokenizers["tok-1"].last_seen = now
    client._on_stats(_stats(ready=False))
    assert not client.health()[0]
    client._on_stats(_stats())
    client.stats_time = now - 5
    assert not client.health()[0]  # stale scheduler stats
