"""The publisher on the wire: frames, sequence numbers, replay and both encodings, checked by a
subscriber decoding with structs declared from vLLM's schema (tests/kv_events/subscriber.py)."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from stoker.services.scheduler.block_manager import BlockManager
from stoker.services.scheduler.kv_events import KVEventsConfig, ZmqEventPublisher, make_publisher
from tests.kv_events.subscriber import Replica, replay

BS = 4


def _sub(ctx: zmq.Context, endpoint: str, topic: bytes) -> zmq.Socket:
    """A SUB whose subscription has reached the PUB: a PUB drops what it sends before then."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        assert monitor.poll(10_000), "no handshake with the publisher"
        recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
    # The subscription goes out right after the handshake; nothing on this side shows when the
    # PUB's I/O thread has read it, so a margin for that one local hop remains.
    time.sleep(0.2)
    return sub


def _workload(bm: BlockManager, publisher: ZmqEventPublisher, rng: random.Random) -> int:
    """Shared-prefix prompts through a small pool (so it evicts), one publish per step."""
    steps, live = 0, []
    prefixes = [[rng.randrange(3) for _ in range(8)] for _ in range(3)]
    for n in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        sid = f"s{n}"
        if bm.allocate_prefix(sid, prompt[:-1]) is not None:
            if bm.allocate_slots(sid, len(prompt)) is None:
                bm.free(sid)
            else:
                bm.cache_blocks(sid, prompt, len(prompt))
                live.append(sid)
        if len(live) > 2:
            bm.free(live.pop(0))
        if n == 40:
            for sid in live:
                bm.free(sid)
            live = []
            assert bm.reset_prefix_cache()
        bm.begin_step()
        publisher.publish(bm.take_events())
        steps += 1
    return steps


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_stream_and_replay_rebuild_the_cache(tmp_path, encoding: str) -> None:
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=pub_ep,
        replay_endpoint=replay_ep,
        topic="kv@replica-0",
        event_encoding=encoding,
    )
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context()
    try:
        sub = _sub(ctx, pub_ep, b"kv@")
        bm = BlockManager(10, BS, record_events=True)
        _workload(bm, publisher, random.Random(7))
        live, seqs = Replica(encoding), []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@replica-0" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            batch = live.apply(payload)
            assert batch.data_parallel_rank == 0 and batch.ts > 0
            if live.index == bm.cached_blocks() and seqs[-1] == publisher._seq - 1:
                break
        assert seqs == list(range(len(seqs))) and seqs[0] == 0  # from 0, no gaps
        assert live.index == bm.cached_blocks() and live.block_size == BS
        assert len(live.index) > 0
        # A subscriber that missed everything catches up from the replay buffer.
        late = Replica(encoding)
        replayed = replay(ctx, replay_ep)
        assert [s for s, _ in replayed] == seqs
        for _, payload in replayed:
            late.apply(payload)
        assert late.index == bm.cached_blocks()
        assert [s for s, _ in replay(ctx, replay_ep, start=seqs[-2])] == seqs[-2:]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_wire_shape_is_vllms() -> None:
    """Positional events tagged by class name, inside a positional batch (the array form)."""
    publisher = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://x")
    )
    try:
        from stoker.services.scheduler.block_manager import BlocksRemoved, BlocksStored

        batch = publisher._batch([BlocksStored([5, 6], None, list(range(8))), BlocksRemoved([5])])
        raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
        assert raw[1] == [
            ["BlockStored", [5, 6], None, list(range(8)), 4, None, "GPU", None],
            ["BlockRemoved", [5], "GPU"],
        ]
        assert raw[2] == 0 and isinstance(raw[0], float)
    finally:
        publisher.close()


def test_full_queue_drops_and_leaves_a_gap(tmp_path) -> None:
    pub_ep = f"ipc://{tmp_path}/pub"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep, max_queue_size=1)
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context()
    try:
        sub = _sub(ctx, pub_ep, b"")
        bm = BlockManager(64, BS, record_events=True)
        n = 3000
        t0 = time.perf_counter()
        for i in range(n):
            bm.allocate_slots(i, BS)
            bm.cache_blocks(i, [i, i, i, i], BS)
            publisher.publish(bm.take_events())
            bm.free(i)
        per_publish = (time.perf_counter() - t0) / n
        assert publisher.dropped > 0
        seqs = []
        while sub.poll(1000):
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert seqs == sorted(set(seqs)) and seqs[-1] <= n - 1
        assert len(seqs) == n - publisher.dropped  # every batch not dropped arrived; gaps show
        assert per_publish < 1e-3  # enqueueing never waits on the sender
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_config() -> None:
    assert make_publisher(None) is None
    assert make_publisher('{"enable_kv_cache_events": false}') is None
    assert make_publisher('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "t"}')
    assert c.publisher == "zmq" and c.endpoint == "tcp://*:5557" and c.active
    assert (c.buffer_steps, c.hwm, c.max_queue_size) == (10_000, 100_000, 100_000)
    for bad in ("[1]", "{", '{"endpoint_typo": 1}', '{"publisher": "kafka"}', '{"hwm": 0}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
