"""Greedy output equals transformers token for token (float32) for the families beyond Llama:
Gemma 2/3, Phi-3, Qwen3-MoE, Mixtral, and Mistral / Qwen2 with sliding windows on.

Shapes are chosen to make each feature matter: windows of 8-16 tokens under prompts of up to 64
and 32 new tokens, head_dim != hidden / heads, GQA, soft-capping, partial rotary, dense and
sparse layers mixed. Each family runs one mixed regime (below); Mixtral and windowed Qwen2
are marked slow.
"""

from __future__ import annotations

import random

import pytest

from stoker.services.engine import LLM
from tests.engine.test_exactness import GREEDY, _hf_greedy
from tests.factory import make_model

FAMILIES = {
    "gemma2": dict(
        num_layers=3,
        head_dim=32,  # != 64 / 4
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0,
    ),
    "gemma3": dict(
        num_layers=3,
        head_dim=32,
        sliding_window=8,
        query_pre_attn_scalar=20,
        final_logit_softcapping=6.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "phi3": dict(num_heads=2, num_kv_heads=1, sliding_window=12, partial_rotary_factor=0.5),
    "qwen3_moe": dict(
        num_layers=3,
        head_dim=32,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # one dense layer between sparse ones
        use_sliding_window=True,
        sliding_window=10,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    "mistral-window": dict(sliding_window=8, head_dim=32),
    # Qwen2 windows only layers >= max_window_layers: one global layer, one windowed.
    "qwen2-window": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
}


SLOW = {"mixtral", "qwen2-window"}  # covered in the default run by qwen3_moe / gemma
LENGTHS = [1, 5, 9, 17, 31, 40, 50, 64]


def _prompts(seed: int, shared_prefix: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in FAMILIES]
)
def test_family_matches_transformers(name, tmp_path):
    """One run that mixes every paged path: shared prefixes hit the prefix cache, a 24-token
    budget chunks the prompts and mixes them with decodes, and a 16-block pool forces
    preemption by recompute (a lone request of up to 120 tokens still fits)."""
    path = make_model(tmp_path / "model", name.split("-")[0], **FAMILIES[name])
    prompts = _prompts(3, shared_prefix=24)
    ref = _hf_greedy(path, prompts)
    llm = LLM(path, num_kv_blocks=16, block_size=8, max_num_seqs=4, max_num_batched_tokens=24)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks, "KV blocks leaked"
    assert llm.engine.scheduler.prefix_hits > 0, "shared prefixes should hit the cache"
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert got == ref
