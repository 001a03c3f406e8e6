"""The worker's warm-up request leaves nothing behind: no request state, no real KV block
touched, and the outputs that follow are the same as without it."""

from __future__ import annotations

import random

import torch

from stoker.services.engine import LLM, SamplingParams
from stoker.services.worker.warmup import warm_up
from tests.factory import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_warm_up_touches_only_the_scratch_block(tmp_path):
    path = make_model(tmp_path / "m", "qwen3", head_dim=32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 20, 41)]
    want = [o.token_ids for o in LLM(str(path), num_kv_blocks=32).generate(prompts, GREEDY)]

    llm = LLM(str(path), num_kv_blocks=32)
    runner = llm.engine.runner
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    assert warm_up(runner) > 0
    assert runner.requests == {}
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        assert torch.equal(k0[:-1], k1[:-1]) and torch.equal(v0[:-1], v1[:-1])
        assert not torch.equal(k0[-1], k1[-1])  # the scratch block took the throwaway K/V
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks() == blocks.num_blocks
