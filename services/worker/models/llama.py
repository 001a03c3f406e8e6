"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm) and Phi-3 (fused
qkv / gate_up in the checkpoint, partial rotary), which differ only in flags of the shared
attention block and in checkpoint names (loader.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from stoker.common.model_config import ModelConfig
from stoker.kernels import cpu_ops
from stoker.kernels.dispatch import add_rms_norm, native_allowed
from stoker.services.worker.attention_metadata import AttentionMetadata
from stoker.services.worker.models.layers import (
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

__all__ = ["DecoderLayer", "LlamaForCausalLM", "enable_native_layers", "pack_linear_weights"]


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP. `mlp` is any [T, hidden] -> [T, hidden] module (a gated MLP,
    or a mixture of experts in moe.py).

    On the CPU a layer `enable_native_layers` marked runs each step in one native call,
    `cpu_ops.llama_layer`: the same kernels in the same order, bit for bit the same output,
    without the Python between them (about 75 us a layer)."""

    native_forward = None  # the native layer function, where enable_native_layers set it
    native_prompts = False  # whether it also takes steps with prompt chunks

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
        native = self.native_forward
        if native is not None and kv_cache[0].dtype == hidden.dtype:
            # Prompt chunks go natively only as the batched prefill kernel's tables.
            batched = not meta.prefills or (self.native_prompts and meta.prefill_tables is not None)
            if batched and native_allowed():
                attn, mlp = self.attn, self.mlp
                return native(
                    hidden, residual, self.input_norm, attn.qkv_proj, attn.qkv_bias, attn.q_norm,
                    attn.k_norm, attn.o_proj, self.post_attn_norm, mlp.gate_up_proj,
                    mlp.down_proj, *rope, *kv_cache, meta.slot_mapping, meta.num_decode,
                    meta.decode_block_tables, meta.decode_context_lens, meta.prefill_tables,
                    meta.prefill_bounds, meta.prefill_lens, meta.out_rows, attn.num_heads,
                    attn.num_kv_heads, attn.head_dim, self.eps, attn.scale, attn.window or 0,
                    attn.softcap or 0.0,
                )  # fmt: skip
        hidden, residual = input_norm(hidden, residual, self.input_norm, self.eps)
        hidden = self.attn(hidden, rope, kv_cache, meta)
        residual = keep_rows(residual, meta)
        hidden, residual = add_rms_norm(hidden, residual, self.post_attn_norm, self.eps)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(cfg, layer)


def enable_native_layers(root: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Mark the decoder layers under `root` that `cpu_ops.llama_layer` runs exactly as their
    Python forward does: Llama-style ones (Qwen3's q/k norm included) with full rotary, a SiLU
    gated MLP, not sharded, whose attention shape the native decode kernel takes (and, for
    steps with prompt chunks, the native prefill kernel). Returns how many.
    STOKER_NATIVE_LAYER=off keeps every layer in Python (for A/B runs)."""
    if os.environ.get("STOKER_NATIVE_LAYER", "on") == "off":
        return 0
    module = cpu_ops.load() if device.type == "cpu" else None
    if module is None:
        return 0
    marked = 0
    for layer in root.modules():
        if type(layer) is not DecoderLayer:
            continue
        attn, mlp = layer.attn, layer.mlp
        if (
            type(attn) is Attention
            and attn.rotary_dim == attn.head_dim
            and type(mlp) is GatedMLP
            and mlp.act is F.silu
            and cpu_ops.supports(dtype, device, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        ):
            layer.native_forward = module.llama_layer
            layer.native_prompts = bool(module.prefill_supports(attn.head_dim))
            marked += 1
    return marked
