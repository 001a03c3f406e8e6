"""Over a real `stoker serve`: the vLLM metric aliases, and the KV event stream a router would
subscribe to. The subscriber's view must predict every request's prefix-cache hit exactly."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import zmq

from tests.deploy.procs import free_port, post_json, wait_healthy
from tests.factory import make_model
from tests.kv_events.subscriber import Replica, replay

BS = 4
NUM_BLOCKS = 64  # 256 token slots: the workload below needs about 90 blocks, so it evicts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kv_events") / "model", "llama")


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _drain(sub: zmq.Socket, replica: Replica, seqs: list[int], quiet_ms: int = 300) -> None:
    while sub.poll(quiet_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        seqs.append(int.from_bytes(seq, "big"))
        replica.apply(payload)


def test_metric_aliases_and_kv_events_predict_prefix_hits(model, tmp_path) -> None:
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")  # before the server binds: ZMQ reconnects
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--tokenizers", "1", "--run-dir", str(tmp_path / "run")]
    cmd += ["--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BS)]
    cmd += ["--kv-events-config", json.dumps(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{base}/health", procs=[proc])

        def complete(prompt: list[int], max_tokens: int, **extra) -> dict:
            body = {"model": model.name, "prompt": prompt, "max_tokens": max_tokens, **extra}
            return post_json(f"{base}/v1/completions", json.dumps(body).encode())

        # -- metric aliases, scraped while a long request runs (so the values are not all 0)
        seen = None
        # Stats come every 0.25 s, and at once when the engine goes idle, so a request that
        # starts as the last one ends sees its first tick 0.25 s in; the long request can be
        # shorter than that on a fast box. A random start puts a tick inside it most times.
        rng = random.Random(0)
        for _ in range(20):
            time.sleep(rng.uniform(0.0, 0.25))
            long = threading.Thread(
                target=complete, args=([1, 2, 3], 240), kwargs={"ignore_eos": True}, daemon=True
            )
            long.start()
            while long.is_alive() and seen is None:
                m = _metrics(f"{base}/metrics")
                if m.get("stoker:num_requests_running") == 1.0:
                    seen = m
                time.sleep(0.02)
            long.join(60)
            if seen is not None:
                break
        assert seen is not None, "never saw the long request running"
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert seen[f"vllm:{name}"] == seen[f"stoker:{name}"], name
        assert 0.0 < seen["vllm:kv_cache_usage_perc"] <= 1.0  # a fraction, as vLLM's
        # The deprecated name SMG's load monitor reads (docs/fleet.md).
        assert seen["vllm:gpu_cache_usage_perc"] == seen["stoker:kv_cache_usage_perc"]

        # -- KV events: a shared-prefix workload through a pool small enough to evict
        replica, seqs = Replica(), []
        _drain(sub, replica, seqs)
        rng = random.Random(3)
        prefixes = [[rng.randrange(10, 400) for _ in range(24)] for _ in range(3)]
        prompts = [p + [rng.randrange(10, 400) for _ in range(rng.randrange(2, 16))]
                   for p in prefixes for _ in range(3)]  # fmt: skip
        workload = [rng.choice(prompts) for _ in range(30)]
        hits = []
        for prompt in workload:
            predicted = replica.prefix_hit(prompt)
            out = complete(prompt, 2)
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted, prompt
            hits.append(predicted)
            _drain(sub, replica, seqs)
        assert sum(hits) > 0 and any(h >= 24 for h in hits)  # the shared prefixes hit
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
        # A router joining late rebuilds the same view from the replay socket.
        late = Replica()
        replayed = replay(ctx, f"tcp://127.0.0.1:{replay_port}")
        assert [s for s, _ in replayed][0] == 0 and replayed[-1][0] == seqs[-1]
        removed = 0
        for _, payload in replayed:
            batch = late.apply(payload)
            removed += sum(isinstance(e, late.Removed) for e in batch.events)
        assert late.index == replica.index and replica.block_size == BS
        assert removed > 0, "the workload should have evicted blocks"
        assert len(late.index) <= NUM_BLOCKS
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        ctx.destroy(linger=0)
