"""config.json -> ModelConfig for the families beyond Llama (no model is built), and the
routing of the mixture-of-experts block against a per-token loop."""

from __future__ import annotations

import pytest
import torch

from stoker.common.model_config import ModelConfig, ModelLoadError, resolve_max_model_len
from stoker.services.worker.models import model_class
from stoker.services.worker.models.gemma import GemmaForCausalLM
from stoker.services.worker.models.moe import MoeForCausalLM, SparseMoE

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _cfg(arch: str, **raw) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [arch], **BASE, **raw})


def test_gemma2_alternates_windows_and_reads_its_settings():
    cfg = _cfg(
        "Gemma2ForCausalLM",
        sliding_window=16,
        query_pre_attn_scalar=64,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert cfg.layer_windows == (16, None, 16, None)
    assert cfg.attn_scale == 64**-0.5
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert model_class(cfg) is GemmaForCausalLM


def test_gemma3_legacy_rope_keys_and_pattern():
    """transformers 4.x configs: rope_theta, rope_local_base_freq, sliding_window_pattern."""
    cfg = _cfg(
        "Gemma3ForCausalLM",
        sliding_window=8,
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    assert cfg.layer_windows == (8, None, 8, None)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.qk_norm and cfg.attn_softcap is None


def test_gemma3_per_layer_type_rope_parameters():
    cfg = _cfg(
        "Gemma3ForCausalLM",
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
        },
    )
    assert cfg.layer_windows == (None, 8, None, 8)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (5e5, 2e4, None)


def test_bidirectional_gemma_is_refused():
    with pytest.raises(ModelLoadError, match="bidirectional"):
        _cfg("Gemma3ForCausalLM", use_bidirectional_attention=True)


def test_qwen_windows_only_when_asked_and_from_max_window_layers():
    assert _cfg("Qwen2ForCausalLM", sliding_window=8).layer_windows == ()
    cfg = _cfg("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert cfg.layer_windows == (None, None, 8, 8)


def test_phi3_partial_rotary_and_window_on_every_layer():
    cfg = _cfg(
        "Phi3ForCausalLM",
        sliding_window=12,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    assert cfg.rotary_dim == 4 and cfg.layer_windows == (12,) * 4


def test_longrope_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="longrope"):
        _cfg("Phi3ForCausalLM", rope_scaling={"rope_type": "longrope", "short_factor": [1.0]})


def test_qwen3_moe_dense_and_sparse_layers():
    cfg = _cfg(
        "Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    assert cfg.moe_layers == (False, True, False, False)
    assert not cfg.norm_topk_prob and model_class(cfg) is MoeForCausalLM
    mixtral = _cfg("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)
    assert mixtral.moe_layers == (True,) * 4 and mixtral.norm_topk_prob


def test_window_no_longer_caps_max_model_len():
    cfg = _cfg("MistralForCausalLM", sliding_window=8, max_position_embeddings=4096)
    assert resolve_max_model_len(cfg, None) == 4096


@pytest.mark.parametrize("renormalise", [False, True])
def test_sparse_moe_equals_a_per_token_loop(renormalise):
    cfg = _cfg(
        "Qwen3MoeForCausalLM",
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=renormalise,
    )
    moe = SparseMoE(cfg)
    gen = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    x = torch.randn(23, 32, generator=gen)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.router.T, dim=-1)
        weights, experts = probs.topk(2)
        if renormalise:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            gate, up = (moe.gate_up_proj[e] @ x[t]).chunk(2)
            want[t] += w * (moe.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
    weights, experts = moe.route(x)
    torch.testing.assert_close(moe._dense(x, weights, experts), want, rtol=1e-5, atol=1e-5)
