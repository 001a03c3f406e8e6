"""Two "nodes" on loopback, torchrun's way: node 0 runs `stoker serve -tp 2 --nnodes 2
--node-rank 0`, node 1 only `stoker worker ... --node-rank 1`, both pointing at node 0's
--master-addr/--master-port. Each node holds one rank. The official openai client gets what one
rank gives offline, token for token (greedy, float32, gloo on CPU), and node 1's worker ends
when node 0 stops."""

from __future__ import annotations

import subprocess
import sys

import pytest
from openai import OpenAI

from stoker.common.sampling_params import SamplingParams
from stoker.services.engine import LLM
from tests.deploy.procs import free_port
from tests.factory import make_model
from tests.reliability.serve import ENV, REPO, Served

PROMPTS = ["To be or not to be", "def add(a, b):"]
ENGINE = ["--num-kv-blocks", "64", "--block-size", "8"]


@pytest.mark.slow
def test_two_nodes_on_loopback_match_one_rank(tmp_path):
    model = make_model(tmp_path / "model", "llama", num_kv_heads=2)
    with LLM(str(model), num_kv_blocks=64, block_size=8) as offline:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        want = [o.text for o in offline.generate(PROMPTS, params)]

    port = free_port()
    multi = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1_log = open(tmp_path / "node1.log", "w")  # noqa: SIM115
    node1 = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "worker", "--model", str(model), *ENGINE, *multi,
         "--node-rank", "1"],
        cwd=REPO, env=ENV, stdout=node1_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = None
    try:
        server = Served(model, tmp_path / "run", tmp_path / "node0.log", *ENGINE, *multi,
                        "--node-rank", "0")  # fmt: skip
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        body = dict(max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
        got = [
            client.completions.create(model=model.name, prompt=p, **body).choices[0].text
            for p in PROMPTS
        ]
        assert got == want
        stats = server.wait_blocks_free()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        server.stop()
        server = None
        assert node1.wait(timeout=60) is not None, "node 1 outlived node 0"
    finally:
        if server is not None:
            server.stop(expect=None)
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        node1_log.close()
