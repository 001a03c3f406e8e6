"""Api pieces without processes: SSE coalescing, n-way accumulation, /health rules."""

from __future__ import annotations

import asyncio
import time

import msgspec

from stoker.common.addresses import Addresses
from stoker.common.messages import SchedulerStats, TextDelta, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.common.wire_digest import PROTOCOL
from stoker.services.api.app import Api
from stoker.services.api.delta_queue import DeltaQueue
from stoker.services.api.engine_client import EngineClient, _Tokenizer
from stoker.services.api.openai_schema import Generation
from stoker.services.api.responses import Accumulator, Formatter
from stoker.services.api.tokens import TokenStrings


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
