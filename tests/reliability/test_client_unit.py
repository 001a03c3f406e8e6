"""EngineClient accounting without sockets: the waiting count behind --max-queued-requests, a
new incarnation in a tokenizer's slot, and failing everything when the engine is lost."""

from __future__ import annotations

import asyncio

from stoker.common.addresses import Addresses
from stoker.common.messages import (
    SchedulerStats,
    TextBatch,
    TextDelta,
    TokenizerHeartbeat,
    pack_ids,
)
from stoker.common.wire_digest import PROTOCOL
from stoker.services.api.engine_client import EngineClient, _Track


def _client(**kw) -> EngineClient:
    client = EngineClient(Addresses.in_run_dir("/nonexistent"), num_tokenizers=1, **kw)
    client.aborts = []
    client._send_abort = client.aborts.extend  # no sockets
    return client


def _track(client: EngineClient, req_id: str, tokenizer: str = "tok-0-aaaa") -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    client._tracks[req_id] = _Track(queue, 0.0, tokenizer=tokenizer, tokenizer_pid=1)
    client.num_waiting += 1
    return queue


def test_waiting_count_and_admission():
    client = _client(max_queued_requests=2)
    _track(client, "a")
    _track(client, "b")
    error = client.admission_error(1)
    assert error is not None and error.status == 503 and error.code == "overloaded"
    # A first token takes "a" out of the queue; a finished or released request leaves too.
    client._dispatch(TextBatch("tok-0-aaaa", [TextDelta("a", "x", pack_ids([7]))]))
    assert client.num_waiting == 1 and client.admission_error(1) is None
    client.release(["b"])
    client._dispatch(TextBatch("tok-0-aaaa", [TextDelta("a", "", b"", finish_reason="stop")]))
    assert client.num_waiting == 0 and client.num_inflight == 0


def test_new_incarnation_in_a_slot_fails_the_old_ones_requests_at_once():
    client = _client()
    client._on_heartbeat(TokenizerHeartbeat("tok-0-aaaa", 10, 0, slot="tok-0", protocol=PROTOCOL))
    queue = _track(client, "r1", tokenizer="tok-0-aaaa")
    # pid 1 again
    client._on_heartbeat(TokenizerHeartbeat("tok-0-bbbb", 10, 0, slot="tok-0", protocol=PROTOCOL))
    delta = queue.get_nowait()
    assert delta.error_status == 503 and "tok-0-aaaa" in delta.error
    assert list(client.tokenizers) == ["tok-0-bbbb"] and client.aborts == ["r1"]
    # Two live processes on one host share a default slot (tok-<host>) but not a pid: both stay.
    client._on_heartbeat(TokenizerHeartbeat("tok-0-cccc", 11, 0, slot="tok-0", protocol=PROTOCOL))
    assert sorted(client.tokenizers) == ["tok-0-bbbb", "tok-0-cccc"]


def test_engine_lost_fails_everything_until_a_ready_worker_is_reported():
    client = _client()
    queues = [_track(client, f"r{i}") for i in range(3)]
    client.engine_lost("the worker exited")
    for q in queues:
        assert q.get_nowait().error_status == 503
    assert client.num_inflight == 0 and client.num_waiting == 0
    assert not client.health()[0] and client.admission_error(1) is not None
    client._on_stats(SchedulerStats(True, 0, 0, 8, 8, 0.0, 0, 0, 0, 64, "m", protocol=PROTOCOL))
    assert client.engine_error is None and client.admission_error(1) is None


def test_steady_rows_reach_their_queues_and_metrics_like_items():
    """A TextBatch's steady columns are one-token deltas, queued and counted as items are; a
    row for a request aborted here gets a late abort, one for an unknown request is dropped,
    and one for a request with no first token yet takes the item path."""
    client = _client()
    a, b, c = _track(client, "a"), _track(client, "b"), _track(client, "c")
    firsts = [TextDelta("a", "x", pack_ids([7])), TextDelta("b", "y", pack_ids([8]))]
    client._dispatch(TextBatch("tok-0-aaaa", firsts))
    assert client.num_waiting == 1  # "c" has no token yet
    tokens, itl_count = client.metrics.generation_tokens, sum(client.metrics.itl.counts)
    itl_total = client.metrics.itl.total
    client._tracks["b"].last -= 0.5  # its gap differs from "a"'s
    lasts = {r: client._tracks[r].last for r in ("a", "b")}
    client._aborted["gone"] = 0.0
    steady = ["a", "gone", "nobody", "b", "c"]
    client._dispatch(TextBatch("tok-0-aaaa", [], steady, list("12345"), pack_ids(range(10, 15))))
    assert [a.get_nowait() for _ in range(2)] == [firsts[0], TextDelta("a", "1", pack_ids([10]))]
    assert [b.get_nowait() for _ in range(2)] == [firsts[1], TextDelta("b", "4", pack_ids([13]))]
    assert c.get_nowait() == TextDelta("c", "5", pack_ids([14]))
    assert client.aborts == ["gone"]
    assert client.num_waiting == 0
    assert client.metrics.generation_tokens == tokens + 3
    assert sum(client.metrics.itl.counts) == itl_count + 2  # "c"'s token was its first
    now = client._tracks["a"].last
    assert client._tracks["b"].last == now
    gaps = sum(now - last for last in lasts.values())
    assert abs(client.metrics.itl.total - itl_total - gaps) < 1e-9


def test_one_batch_of_items_and_steady_rows_for_different_requests():
    """Items (a first token, a finish) and steady rows in one TextBatch: each request gets its
    own deltas in order, the finished one leaves, and the counts add up."""
    client = _client()
    a, b, c = _track(client, "a"), _track(client, "b"), _track(client, "c")
    client._dispatch(TextBatch("tok-0-aaaa", [TextDelta(r, "x", pack_ids([1])) for r in "ab"]))
    tokens = client.metrics.generation_tokens
    items = [
        TextDelta("a", "!", pack_ids([2]), finish_reason="stop"),
        TextDelta("c", "first", pack_ids([3]), num_prompt_tokens=4),
    ]
    client._dispatch(TextBatch("tok-0-aaaa", items, ["b"], ["y"], pack_ids([4])))
    assert [a.get_nowait().text for _ in range(2)] == ["x", "!"]
    assert [b.get_nowait().text for _ in range(2)] == ["x", "y"]
    assert c.get_nowait().text == "first"
    assert client.num_inflight == 2 and client.num_waiting == 0  # "a" finished
    assert client.metrics.generation_tokens == tokens + 3
