"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm) and Phi-3 (fused
qkv / gate_up in the checkpoint, partial rotary), which differ only in flags of the shared
attention block and in checkpoint names (loader.py)."""

from __future__ import annotations

import torch
from torch import nn

from common.model_config import ModelConfig
from kernels.dispatch import add_rms_norm
from services.worker.attention_metadata import AttentionMetadata
from services.worker.models.layers import (
    Attention,
    CausalLM,
    GatedMLP,
    KVCache,
    Rope,
    input_norm,
    keep_rows,
    pack_linear_weights,
    param,
)

__all__ = ["DecoderLayer", "LlamaForCausalLM", "pack_linear_weights"]


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP. `mlp` is any [T, hidden] -> [T, hidden] module (a gated MLP,
    or a mixture of experts in moe.py)."""

    def __init__(self, cfg: ModelConfig, layer: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = param(cfg.hidden_size)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = param(cfg.hidden_size)
        self.mlp = mlp or GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(hidden, residual, self.input_norm, self.eps)
        hidden = self.attn(hidden, rope, kv_cache, meta)
        residual = keep_rows(residual, meta)
        hidden, residual = add_rms_norm(hidden, residual, self.post_attn_norm, self.eps)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(cfg, layer)
