"""The --kv-events-config object (docs/kv-events.md): vLLM's KVEventsConfig fields. A config, so
the flags check it while parsing; the publisher that reads it lives in the scheduler."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal


@dataclasses.dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig fields, plus stoker's `event_encoding`."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, as in vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_encoding: Literal["array", "map"] = "array"

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher must be zmq or null, got {self.publisher!r}")
        if self.event_encoding not in ("array", "map"):
            raise ValueError(f"event_encoding must be array or map, got {self.event_encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from e
        if not isinstance(fields, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown fields {unknown}")
        return cls(**fields)

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"
