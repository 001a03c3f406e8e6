"""Gemma 2 and Gemma 3 (text): the shared attention block with Gemma's settings, and a layer
with four norms (post-attention and pre/post-feedforward around the MLP).

What differs from Llama, each from transformers' modeling_gemma2/3.py:
- RMSNorm scales by (1 + w): the loader stores 1 + w, so the ordinary norm kernels apply;
- embeddings are multiplied by sqrt(hidden), rounded to the weights' dtype first;
- gelu-tanh gated MLP; scores scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers alternate with global ones (`layer_types`, per layer window);
- Gemma 2: attention scores and final logits soft-capped with tanh;
- Gemma 3: q/k norm, and the sliding-window layers use their own rope base (local theta).
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.common.model_config import ModelConfig
from stoker.kernels.dispatch import add_rms_norm, rms_norm
from stoker.services.worker.attention_metadata import AttentionMetadata
from stoker.services.worker.models.layers import (
    Attention,
    CausalLM,
    GatedMLP,
    KVCache,
    Rope,
    input_norm,
    keep_rows,
    param,
)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = param(cfg.hidden_size)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = param(cfg.hidden_size)
        self.pre_ff_norm = param(cfg.hidden_size)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.post_ff_norm = param(cfg.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(hidden, residual, self.input_norm, self.eps)
        hidden = rms_norm(self.attn(hidden, rope, kv_cache, meta), self.post_attn_norm, self.eps)
        residual = keep_rows(residual, meta)
        hidden, residual = add_rms_norm(hidden, residual, self.pre_ff_norm, self.eps)
        return rms_norm(self.mlp(hidden), self.post_ff_norm, self.eps), residual


class GemmaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size**0.5

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, layer)
