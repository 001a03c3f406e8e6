"""The scheduler never drops a token batch silently: a tokenizer that is gone (or too far
behind for the send high-water mark) is failed loudly, its requests aborted (blocks freed) and
reported to the api as lost."""

from __future__ import annotations

import asyncio

import msgspec
import zmq

from common.addresses import API_ROUTING_ID, Addresses
from common.config import EngineConfig
from common.ipc import api_from_scheduler_decoder
from common.messages import EngineFailure, GenerateRequest, RequestTokens, WorkerReady, pack_ids
from common.sampling_params import SamplingParams
from services.scheduler.service import SchedulerService


def test_unreachable_tokenizer_is_failed_loudly(model, tmp_path):
    # In an event loop, as in the scheduler process: its sockets are asyncio ones.
    asyncio.run(_unreachable_tokenizer(model, tmp_path))


async def _unreachable_tokenizer(model, tmp_path) -> None:
    addresses = Addresses.in_run_dir(tmp_path / "run")
    service = SchedulerService(EngineConfig(model=str(model), null_model=True), addresses)
    api = zmq.Context.instance().socket(zmq.DEALER)  # stands in for the api
    api.setsockopt(zmq.ROUTING_ID, API_ROUTING_ID)
    api.connect(addresses.scheduler)
    try:
        service._start(WorkerReady(num_blocks=16, block_size=16, max_model_len=64, vocab_size=256))
        request = GenerateRequest("r-1", pack_ids([5, 6, 7]), SamplingParams(max_tokens=4))
        service._add(b"tok-gone", request)  # its tokenizer never connected (or went away)
        assert service.scheduler.num_waiting == 1
        await asyncio.sleep(0.2)  # the api's connection is up
        service._send_batches({b"tok-gone": [RequestTokens("r-1", pack_ids([9]))]})
        assert service.scheduler.num_waiting == 0 and not service.owners
        assert service.blocks.num_free_blocks() == service.blocks.num_blocks
        assert api.poll(5000), "nothing reached the api"
        msg = api_from_scheduler_decoder.decode(api.recv())
        assert isinstance(msg, EngineFailure) and msg.req_ids == ["r-1"]
        assert "tok-gone" in msg.message
    finally:
        api.close(linger=0)
        service.ctx.destroy(linger=0)


def test_messages_decode_with_defaults():
    """New fields have defaults, so a peer from before them still decodes."""
    enc = msgspec.msgpack.Encoder()
    old = enc.encode(["worker_ready", 4, 16, 64, 256])
    assert msgspec.msgpack.decode(old, type=WorkerReady).incarnation == ""
