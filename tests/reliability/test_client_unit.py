"""EngineClient accounting without sockets: the waiting count behind --max-queued-requests, a
new incarnation in a tokenizer's slot, and failing everything when the engine is lost."""

from __future__ import annotations

import asyncio

from common.addresses import Addresses
from common.messages import SchedulerStats, TextBatch, TextDelta, TokenizerHeartbeat, pack_ids
from services.api.engine_client import EngineClient, _Track


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
    client._on_heartbeat(TokenizerHeartbeat("tok-0-aaaa", 10, 0, slot="tok-0"))
    queue = _track(client, "r1", tokenizer="tok-0-aaaa")
    client._on_heartbeat(TokenizerHeartbeat("tok-0-bbbb", 10, 0, slot="tok-0"))  # pid 1 again
    delta = queue.get_nowait()
    assert delta.error_status == 503 and "tok-0-aaaa" in delta.error
    assert list(client.tokenizers) == ["tok-0-bbbb"] and client.aborts == ["r1"]
    # Two live processes on one host share a default slot (tok-<host>) but not a pid: both stay.
    client._on_heartbeat(TokenizerHeartbeat("tok-0-cccc", 11, 0, slot="tok-0"))
    assert sorted(client.tokenizers) == ["tok-0-bbbb", "tok-0-cccc"]


def test_engine_lost_fails_everything_until_a_ready_worker_is_reported():
    client = _client()
    queues = [_track(client, f"r{i}") for i in range(3)]
    client.engine_lost("the worker exited")
    for q in queues:
        assert q.get_nowait().error_status == 503
    assert client.num_inflight == 0 and client.num_waiting == 0
    assert not client.health()[0] and client.admission_error(1) is not None
    client._on_stats(SchedulerStats(True, 0, 0, 8, 8, 0.0, 0, 0, 0, 64, "m"))
    assert client.engine_error is None and client.admission_error(1) is None
