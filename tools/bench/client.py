"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

TTFT is the time to the first chunk with non-empty content; every later content chunk adds one
inter-token latency (ITL) gap, even when it carries several tokens (as vLLM's benchmark counts
it). Output tokens come from the usage chunk when the server sends one, else one per chunk.

The client is aiohttp, as in vLLM's benchmark: at hundreds of streams httpx's connection pool
costs O(connections) per request and the client, not the server, sets the ceiling.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from stoker.tools.bench.datasets import Prompt, SampleRequest

_decode_event = msgspec.json.Decoder().decode


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens when reported, else the dataset's
    output_tokens: int = 0
    start: float = 0.0  # when it was sent, seconds since the benchmark started
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # end to end, seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # since `start`
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, or None with fewer than two tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _join(system: Prompt | None, prompt: Prompt) -> Prompt:
    if system is None:
        return prompt
    if isinstance(system, list) and isinstance(prompt, list):
        return system + prompt
    if isinstance(system, str) and isinstance(prompt, str):
        return system + prompt
    raise TypeError("system and prompt must both be ids or both be text")


def build_payload(
    sample: SampleRequest,
    *,
    model: str,
    chat: bool,
    temperature: float,
    ignore_eos: bool,
    to_text: Callable[[Prompt], str],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request body: only standard fields (+ ignore_eos when asked), for strict servers."""
    body: dict[str, Any] = {"model": model}
    if chat:
        messages = []
        if sample.system is not None:
            messages.append({"role": "system", "content": to_text(sample.system)})
        messages.append({"role": "user", "content": to_text(sample.prompt)})
        body["messages"] = messages
        body["max_completion_tokens"] = sample.output_len
    else:
        body["prompt"] = _join(sample.system, sample.prompt)
        body["max_tokens"] = sample.output_len
    body["temperature"] = temperature
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(extra or {})}


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text in one streamed chunk (completions or chat); '' when there is none."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if choice.get("text"):
        return choice["text"]
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def sse_data_lines(buffer: bytearray, chunk: bytes) -> list[bytes]:
    """Append a network chunk to `buffer`; return the complete `data:` payloads it finished.

    Chunks split lines anywhere, so a partial line stays in the buffer for the next call."""
    buffer += chunk
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    complete = bytes(buffer[: end + 1])
    del buffer[: end + 1]
    return [
        line[5:].strip()
        for line in complete.split(b"\n")
        if line.startswith(b"data:")  # not blank separators, comments or `event:` lines
    ]


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    prompt_len: int,
    t0: float,
) -> RequestResult:
    """POST one streaming request; never raises: failures come back with `error` set."""
    res = RequestResult(prompt_len=prompt_len)
    st = time.perf_counter()
    res.start = st - t0
    texts: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                res.error = f"HTTP {resp.status}: {body[:1000]}"
                return res
            buffer = bytearray()
            done = False
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                for data in sse_data_lines(buffer, chunk):
                    if data == b"[DONE]":
                        done = True
                        break
                    event = _decode_event(data)  # msgspec: a third of json.loads's CPU
                    if event.get("error"):
                        res.error = f"stream error: {json.dumps(event['error'])[:1000]}"
                        return res
                    if text := chunk_text(event):
                        res.chunk_times.append(now - st)
                        texts.append(text)
                    usage = event.get("usage") or usage
                if done:
                    break
        res.success = True
    except Exception as e:  # a benchmark records every failure and goes on
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency = time.perf_counter() - st
        res.text = "".join(texts)
    if usage.get("prompt_tokens"):
        res.prompt_len = int(usage["prompt_tokens"])
    res.output_tokens = int(usage.get("completion_tokens") or len(res.chunk_times))
    times = res.chunk_times
    res.ttft = times[0] if times else res.latency
    res.itl = [b - a for a, b in zip(times, times[1:])]
    return res


def new_session(
    max_connections: int, timeout_s: float, headers: dict[str, str] | None = None
) -> aiohttp.ClientSession:
    """A session whose pool holds every concurrent stream (no queueing inside the client)."""
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=False)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        headers=headers,
        read_bufsize=1 << 20,
    )
