"""LLM(tensor_parallel_size=2) against LLM at one rank: greedy output token for token in float32
on CPU (gloo), per family, with prefix caching and speculation on, chunked prefill mixed with
decodes and a pool small enough to preempt. Two ranks are real processes.

The default run covers a GQA Llama with one KV head (replicated over both ranks), an odd
vocabulary (a padded vocab shard), tied embeddings, a draft model replicated on each rank and a
seeded sampled request (the ranks must sample alike, or rank 1's K/V would drift from rank 0's
tokens). n-gram speculation runs in the serve test and in the other families, here with
-m slow (Qwen3-MoE with a draft model).
"""

from __future__ import annotations

import os
import random

import pytest

from stoker.common.model_config import ModelLoadError
from stoker.common.sampling_params import SamplingParams
from stoker.services.engine import LLM
from tests.engine.test_family_exactness import FAMILIES
from tests.factory import make_model
from tests.parallel.procs import rank_processes

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
ENGINE = dict(num_kv_blocks=24, block_size=8, max_num_seqs=4, max_num_batched_tokens=24)

CASES = {
    "llama-kv1": ("llama", dict(num_kv_heads=1, vocab_size=509, tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", FAMILIES["qwen3_moe"]),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),
    **{n: (n.split("-")[0], FAMILIES[n]) for n in FAMILIES if n != "qwen3_moe"},
}
DEFAULT = {"llama-kv1"}
SPECULATION = {"llama-kv1": "draft", "qwen3_moe": "draft"}


def _prompts(seed: int = 5) -> list[list[int]]:
    """A shared 24-token prefix (prefix cache hits) and repeats the n-gram proposer can use."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(24)]
    tails = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 16, 33)]
    return [prefix + t + prefix[:8] for t in tails]


def _generate(path, params, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), **ENGINE, **options)
    return [o.token_ids for o in llm.generate(_prompts(), params)], llm


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_two_ranks_equal_one(name, tmp_path):
    arch, shape = CASES[name]
    path = make_model(tmp_path / "model", arch, **shape)
    options: dict = {}
    spec = SPECULATION.get(name, "ngram")
    if spec == "draft":
        vocab = shape.get("vocab_size", 512)
        draft = make_model(tmp_path / "draft", "llama", num_layers=1, vocab_size=vocab, seed=1)
        options = dict(speculative="draft", speculative_model=str(draft))
    else:
        options = dict(speculative="ngram")
    params = [GREEDY, GREEDY, SAMPLED, GREEDY] if name == "llama-kv1" else GREEDY
    want, _ = _generate(path, params, **options)
    got, llm = _generate(path, params, tensor_parallel_size=2, **options)
    try:
        engine = llm.engine
        bm = engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks() == bm.num_blocks, "KV blocks leaked"
        assert engine.scheduler.prefix_hits > 0, "the shared prefix should hit the cache"
        assert engine.scheduler.spec.stats.drafts > 0, "speculation should have run"
        procs = engine.ranks.procs
        assert [p.poll() for p in procs] == [None]
    finally:
        llm.close()
    assert all(p.returncode is not None for p in procs), "ranks outlived close()"
    assert got == want


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(tmp_path):
    path = make_model(tmp_path / "model", "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ModelLoadError, match="does not divide the model's 4 attention heads"):
        LLM(str(path), tensor_parallel_size=3)
    assert not rank_processes(os.getpid()), "no rank should have been started"
