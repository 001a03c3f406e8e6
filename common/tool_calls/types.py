"""What the formats produce: parsed calls, and the deltas a streamed choice is built from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits, from (seed, index): a streamed choice gets the same ids
    name: str
    arguments: str  # JSON text, exactly as the model wrote it


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among this choice's calls (OpenAI's tool_calls[].index)
    id: str | None = None  # set on a call's first delta
    name: str | None = None  # set on a call's first delta
    arguments: str = ""  # a chunk of the arguments text


Delta = ContentDelta | ToolCallDelta


def call_id(seed: str, index: int) -> str:
    """Deterministic, so parse() and a stream parser of the same output agree on ids."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]
