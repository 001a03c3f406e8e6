"""The shard math without processes: each rank's slices of the checkpoint, recombined the way
the collectives recombine them (row-parallel partial sums added, vocab-parallel columns
concatenated), equal the full layer. float64, so equal means to rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from stoker.common.model_config import ModelConfig, ModelLoadError
from stoker.services.worker.models.layers import GatedMLP
from stoker.services.worker.parallel.shard import (
    Shard,
    check_divisible,
    local_kv_heads,
    shard_config,
    shard_state,
)

torch.manual_seed(0)
HIDDEN, HEAD_DIM = 16, 4


def _cfg(heads: int = 4, kv: int = 2, inter: int = 8, **extra) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 11,  # not a multiple of the rank count: the last shard is padded
        "hidden_size": HIDDEN,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 64,
        **extra,
    }
    return ModelConfig.from_dict(raw)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    q, kv = cfg.num_heads * HEAD_DIM, cfg.num_kv_heads * HEAD_DIM
    return {
        "embed_tokens": _rand(cfg.vocab_size, HIDDEN),
        "lm_head": _rand(cfg.vocab_size, HIDDEN),
        "norm": _rand(HIDDEN),
        "layers.0.attn.qkv_proj": _rand(q + 2 * kv, HIDDEN),
        "layers.0.attn.qkv_bias": _rand(q + 2 * kv),
        "layers.0.attn.o_proj": _rand(HIDDEN, q),
        "layers.0.mlp.gate_up_proj": _rand(2 * cfg.intermediate_size, HIDDEN),
        "layers.0.mlp.down_proj": _rand(HIDDEN, cfg.intermediate_size),
    }


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.view(x.shape[0], n, HEAD_DIM)


@pytest.mark.parametrize(("heads", "kv", "size"), [(4, 2, 2), (4, 4, 2), (4, 1, 2), (8, 2, 4)])
def test_attention_projections_recombine(heads, kv, size):
    """Column-parallel fused q/k/v: each rank's query heads and the K/V heads they attend with
    are the full model's (GQA groups intact, KV replicated where kv < size); row-parallel o_proj
    partial sums add up to the full projection."""
    cfg = _cfg(heads, kv)
    state = _state(cfg)
    x = _rand(3, HIDDEN)
    qkv = F.linear(x, state["layers.0.attn.qkv_proj"], state["layers.0.attn.qkv_bias"])
    q_full, k_full, _ = qkv.split([heads * HEAD_DIM, kv * HEAD_DIM, kv * HEAD_DIM], -1)
    q_full, k_full = _heads(q_full, heads), _heads(k_full, kv)
    local = shard_config(cfg, size)
    attn = _rand(3, heads * HEAD_DIM)  # stands in for the attention output, head after head
    o_sum = torch.zeros(3, HIDDEN, dtype=torch.float64)
    for rank in range(size):
        part = shard_state(state, cfg, Shard(rank, size))
        out = F.linear(x, part["layers.0.attn.qkv_proj"], part["layers.0.attn.qkv_bias"])
        q, k, _ = out.split([local.num_heads * HEAD_DIM, *[local.num_kv_heads * HEAD_DIM] * 2], -1)
        q, k = _heads(q, local.num_heads), _heads(k, local.num_kv_heads)
        for j in range(local.num_heads):
            head = rank * local.num_heads + j
            assert torch.equal(q[:, j], q_full[:, head])
            # GQA: local query head j reads local KV head j // group; it must be the one the
            # full model's head reads.
            group_local = local.num_heads // local.num_kv_heads
            assert torch.equal(k[:, j // group_local], k_full[:, head // (heads // kv)])
        cols = slice(rank * local.num_heads * HEAD_DIM, (rank + 1) * local.num_heads * HEAD_DIM)
        o_sum += F.linear(attn[:, cols], part["layers.0.attn.o_proj"])
    torch.testing.assert_close(o_sum, F.linear(attn, state["layers.0.attn.o_proj"]))


@pytest.mark.parametrize("size", [2, 4])
def test_gated_mlp_partial_sums_equal_the_full_mlp(size):
    """The real GatedMLP with each rank's gate/up rows and down columns: its outputs summed (the
    all-reduce) equal the full MLP's."""
    cfg = _cfg()
    state = _state(cfg)
    full = GatedMLP(HIDDEN, cfg.intermediate_size, "silu")
    full.gate_up_proj.data = state["layers.0.mlp.gate_up_proj"]
    full.down_proj.data = state["layers.0.mlp.down_proj"]
    x = _rand(5, HIDDEN)
    total = torch.zeros(5, HIDDEN, dtype=torch.float64)
    for rank in range(size):
        part = shard_state(state, cfg, Shard(rank, size))
        mlp = GatedMLP(HIDDEN, cfg.intermediate_size // size, "silu")
        mlp.gate_up_proj.data = part["layers.0.mlp.gate_up_proj"]
        mlp.down_proj.data = part["layers.0.mlp.down_proj"]
        total += mlp(x)
    torch.testing.assert_close(total, full(x))


def test_expert_shards_recombine():
    """3-D expert tensors [E, 2 * inter, hidden] / [E, hidden, inter] split per expert alike."""
    experts, inter, size = 3, 8, 2
    gate_up, down = _rand(experts, 2 * inter, HIDDEN), _rand(experts, HIDDEN, inter)
    state = {"layers.0.mlp.gate_up_proj": gate_up, "layers.0.mlp.down_proj": down}
    x = _rand(4, HIDDEN)
    for e in range(experts):
        g, u = F.linear(x, gate_up[e]).chunk(2, -1)
        want = F.linear(F.silu(g) * u, down[e])
        got = torch.zeros_like(want)
        for rank in range(size):
            part = shard_state(state, _cfg(inter=inter), Shard(rank, size))
            g, u = F.linear(x, part["layers.0.mlp.gate_up_proj"][e]).chunk(2, -1)
            got += F.linear(F.silu(g) * u, part["layers.0.mlp.down_proj"][e])
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_vocab_parallel_embedding_and_head(size):
    """Masked local lookups summed equal the embedding (exactly: one non-zero term per row);
    local logits concatenated, padding cut off, equal the full LM head's."""
    cfg = _cfg()
    state = _state(cfg)
    ids = torch.arange(cfg.vocab_size)
    hidden = _rand(2, HIDDEN)
    emb = torch.zeros(len(ids), HIDDEN, dtype=torch.float64)
    logits = []
    for rank in range(size):
        shard = Shard(rank, size)
        part = shard_state(state, cfg, shard)
        first, rows = shard.vocab_rows(cfg.vocab_size)
        assert part["embed_tokens"].shape == (rows, HIDDEN)
        local = ids - first
        outside = (local < 0) | (local >= rows)
        emb += F.embedding(local.masked_fill(outside, 0), part["embed_tokens"]).masked_fill(
            outside[:, None], 0.0
        )
        logits.append(F.linear(hidden, part["lm_head"]))
    assert torch.equal(emb, state["embed_tokens"])
    gathered = torch.cat(logits, -1)[:, : cfg.vocab_size]
    torch.testing.assert_close(gathered, F.linear(hidden, state["lm_head"]))


def test_replicated_tensors_and_config():
    cfg = _cfg(heads=4, kv=1)
    state = _state(cfg)
    part = shard_state(state, cfg, Shard(1, 2))
    assert torch.equal(part["norm"], state["norm"])
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 4)
    assert local.vocab_size == cfg.vocab_size and local.head_dim == cfg.head_dim
    whole = dict(num_heads=4, num_kv_heads=1, intermediate_size=8, moe_intermediate_size=8)
    assert dataclasses.replace(local, **whole) == cfg  # nothing else changes
    assert local_kv_heads(1, 2) == 1 and local_kv_heads(8, 4) == 2


@pytest.mark.parametrize(
    ("heads", "kv", "inter", "size", "named"),
    [(6, 2, 8, 4, "attention heads"), (4, 3, 8, 2, "KV heads"), (4, 2, 6, 4, "intermediate")],
)
def test_indivisible_models_are_refused(heads, kv, inter, size, named):
    with pytest.raises(ModelLoadError, match=named):
        check_divisible(_cfg(heads, kv, inter), size)
