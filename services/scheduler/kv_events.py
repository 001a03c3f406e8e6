"""KV-cache events on vLLM's ZeroMQ wire format, for routers that track each replica's cache
(llm-d's precise prefix scorer, NVIDIA Dynamo's KV router). docs/kv-events.md has the format.

The scheduler drains the block manager's events once per step into `ZmqEventPublisher.publish`,
which only enqueues: a thread encodes and sends. The loop never blocks on it; when the bounded
queue is full the batch is dropped and counted, and its sequence number is skipped, so a
subscriber sees the gap.

Frames on the PUB socket: `[topic, seq (8-byte big-endian), msgpack KVEventBatch]`. With a
replay endpoint, a ROUTER answers `[b"", seq]` (a REQ/DEALER client's request) with every buffered
batch from seq on, `[b"", seq, payload]` each, then `[b"", -1, b""]`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from stoker.common.kv_events_config import KVEventsConfig
from stoker.services.scheduler.block_manager import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
)

log = logging.getLogger("stoker.kv_events")

# vLLM's name for the pool requests read from; stoker's CPU pool is that pool too.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# ---- wire structs: vLLM's vllm/distributed/kv_events.py schema, field for field -----------------
# The batch is an array; events are tagged by class name. `event_encoding` "array" (the
# default) sends each event as a positional array, as vLLM did through #42892 and as every
# consumer decodes; "map" sends field-name maps, as vLLM does since.


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _event_structs(array_like: bool) -> tuple[type, type, type]:
    class Event(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(Event):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


_STRUCTS = {"array": _event_structs(True), "map": _event_structs(False)}


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.dropped = 0  # batches the full queue refused
        self._structs = _STRUCTS[config.event_encoding]
        self._seq = 0
        self._queue: queue.Queue[tuple[int, _Batch] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = config.endpoint
        # vLLM's rule: bind a wildcard or local endpoint, connect to a named host.
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV events on %s", endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Enqueue one step's events; never blocks."""
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, self._batch(events)))
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: loud, not flooding
                log.warning("KV event queue full: %d batches dropped", self.dropped)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout`), then close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._closed.set()
        self._ctx.destroy(linger=0)

    def _batch(self, events: list[KVEvent]) -> _Batch:
        stored, removed, cleared = self._structs
        out: list[Any] = []
        for e in events:
            if isinstance(e, BlocksStored):
                block_size = len(e.token_ids) // len(e.block_hashes)  # every block is full
                out.append(
                    stored(
                        block_hashes=e.block_hashes,
                        parent_block_hash=e.parent_block_hash,
                        token_ids=e.token_ids,
                        block_size=block_size,
                        lora_id=None,
                        medium=MEDIUM,
                        lora_name=None,
                    )
                )
            elif isinstance(e, BlocksRemoved):
                out.append(removed(e.block_hashes, MEDIUM))
            elif isinstance(e, AllBlocksCleared):
                out.append(cleared())
        return _Batch(time.time(), out, self.dp_rank)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError as e:
                    log.warning("KV event replay failed: %s", e)
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            payload = encoder.encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            try:  # PUB never blocks: past a subscriber's HWM, ZMQ drops for that subscriber
                self._pub.send_multipart((topic, seq_bytes, payload), flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("KV event send failed: %s", e)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("dropped a malformed KV event replay request")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config_json: str | None) -> ZmqEventPublisher | None:
    """The publisher `--kv-events-config` asks for, or None (nothing recorded or sent)."""
    if not config_json:
        return None
    config = KVEventsConfig.from_json(config_json)
    return ZmqEventPublisher(config) if config.active else None
