"""Greedy output equals transformers token for token (float32), in four scheduling regimes."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from stoker.services.engine import LLM, SamplingParams
from tests.factory import make_model

NEW_TOKENS = 32
ARCHS = {
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "mistral": dict(tie_word_embeddings=True),
    "qwen2": dict(),
    "qwen3": dict(head_dim=32),
}


def _prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    lengths = [1, 2, 5, 9, 16, 17, 23, 31, 32, 33, 40, 47, 50, 64, 7, 12]
    return [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _hf_greedy(path, prompts: list[list[int]], **load) -> list[list[int]]:
    """transformers' greedy continuations, one prompt at a time, EOS ignored. `load` goes to
    from_pretrained (e.g. gguf_file=)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_case(request, tmp_path_factory):
    arch = request.param
    path = make_model(tmp_path_factory.mktemp(arch) / "model", arch, **ARCHS[arch])
    plain = _prompts(1)
    shared = _prompts(2, shared_prefix=48)
    return path, plain, shared, _hf_greedy(path, plain), _hf_greedy(path, shared)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _run(path, prompts, **options):
    llm = LLM(path, **options)
    outs = llm.generate(prompts, GREEDY)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks, "KV blocks leaked"
    return llm, [o.token_ids for o in outs]


def test_plain(arch_case):
    path, plain, _, ref, _ = arch_case
    _, got = _run(path, plain, num_kv_blocks=256)
    assert got == ref


def test_chunked_prefill(arch_case):
    path, plain, _, ref, _ = arch_case
    llm, got = _run(path, plain, num_kv_blocks=256, max_num_batched_tokens=24)
    assert got == ref


def test_preemption(arch_case):
    path, plain, _, ref, _ = arch_case
    llm, got = _run(path, plain, num_kv_blocks=14, block_size=8)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert got == ref


def test_prefix_cache_hits(arch_case):
    path, _, shared, _, ref = arch_case
    llm, got = _run(path, shared, num_kv_blocks=256, max_num_seqs=4)
    assert llm.engine.scheduler.prefix_hits > 0, "shared prefixes should hit the cache"
    assert got == ref
