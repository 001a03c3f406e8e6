"""A malformed or unexpected message on any socket is logged and dropped: garbage is written to
every socket a service binds, and afterwards every process is alive and the server serves."""

from __future__ import annotations

import time

import httpx
import msgspec
import zmq

from stoker.common.addresses import Addresses
from stoker.common.messages import Abort, GenerateRequest, SchedulerStats, StepResult, TextBatch
from stoker.common.sampling_params import SamplingParams
from tests.deploy.procs import alive
from tests.reliability.serve import Served

GARBAGE = [b"", b"\x00", b"\xff" * 64, msgspec.msgpack.encode({"x": 1}), b"\x93\x01\x02"]


def test_garbage_on_every_socket_is_dropped(model, tmp_path):
    run = tmp_path / "run"
    server = Served(model, run, tmp_path / "log", "--null-model")
    enc = msgspec.msgpack.Encoder()
    addr = Addresses.in_run_dir(run)
    ctx = zmq.Context()
    try:
        # api_inbound (PULL): garbage, a message of another socket, deltas for unknown ids.
        push = ctx.socket(zmq.PUSH)
        push.connect(addr.api_inbound)
        wrong = [enc.encode(StepResult(1, ["x"], b"\x01")), enc.encode(TextBatch("t", []))]
        for raw in GARBAGE + wrong:
            push.send(raw)
        # scheduler (ROUTER): wrong frame counts, garbage, wrong types, a bad prompt buffer,
        # and an abort of nothing.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, b"intruder")
        dealer.connect(addr.scheduler)
        bad_prompt = GenerateRequest("bad-1", b"\x01\x02\x03", SamplingParams())
        for raw in GARBAGE + [enc.encode(bad_prompt), enc.encode(Abort(["nobody"]))]:
            dealer.send(raw)
        dealer.send_multipart([b"a", b"b", b"c"])
        stats = SchedulerStats(True, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, "m")
        dealer.send(enc.encode(stats))
        # worker_result (PULL, the scheduler's): garbage and a result for no step.
        result = ctx.socket(zmq.PUSH)
        result.connect(addr.worker_result)
        for raw in GARBAGE + [enc.encode(StepResult(999, ["nobody"], b"\x01\x00\x00\x00"))]:
            result.send(raw)
        # tokenizer_requests (the api's ROUTER): a DEALER that is no tokenizer sends garbage.
        fake = ctx.socket(zmq.DEALER)
        fake.connect(addr.tokenizer_requests)
        for raw in GARBAGE:
            fake.send(raw)
        time.sleep(1.0)
        for pid in server.children:
            assert alive(pid), f"process {pid} died"
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        s = server.wait_blocks_free()
        assert s["num_free_blocks"] == s["num_total_blocks"]
        assert "malformed" in server.logs() or "dropped" in server.logs()
    finally:
        ctx.destroy(linger=0)
        server.stop()
