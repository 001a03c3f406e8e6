"""`stoker serve --tensor-parallel-size 2` over real processes: the official openai client gets
what one rank gives offline, token for token (greedy, float32, gloo on CPU), with prefix caching
and n-gram speculation on; the second rank is the worker's child and dies with it, also when
the worker is SIGKILLed."""

from __future__ import annotations

import os
import signal
import time

from openai import OpenAI

from stoker.common.sampling_params import SamplingParams
from stoker.services.engine import LLM
from tests.deploy.procs import alive
from tests.factory import make_model
from tests.parallel.procs import rank_processes
from tests.reliability.serve import Served

PROMPTS = ["To be or not to be", "def add(a, b):", "To be or not to be, that is"]
FLAGS = ["--num-kv-blocks", "64", "--block-size", "8", "--speculative", "ngram"]


def test_serve_two_ranks_matches_one_and_ranks_die_with_the_worker(tmp_path):
    model = make_model(tmp_path / "model", "llama", num_kv_heads=1)
    offline = LLM(str(model), num_kv_blocks=64, block_size=8, speculative="ngram")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.text for o in offline.generate(PROMPTS, params)]

    server = Served(model, tmp_path / "run", tmp_path / "log", *FLAGS, "-tp", "2")
    try:
        (worker,) = server.child("worker")
        (rank1,) = rank_processes(worker)
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        body = dict(max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True})
        got = []
        for prompt in PROMPTS:
            reply = client.completions.create(model=model.name, prompt=prompt, **body)
            got.append(reply.choices[0].text)
        assert got == want
        stats = server.wait_blocks_free()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]

        os.kill(worker, signal.SIGKILL)  # PR_SET_PDEATHSIG takes rank 1 along
        deadline = time.monotonic() + 10
        while alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(rank1), "rank 1 outlived a SIGKILLed worker"
    finally:
        server.stop(expect=None)  # asserts no child of serve is left
