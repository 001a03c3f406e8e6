"""A lean Llama for training on CPU, weight-compatible with transformers' LlamaForCausalLM.

Same function as the HF model (RMSNorm, rotate-half RoPE, SwiGLU, tied embeddings) with fused
QKV and gate/up projections, one causal SDPA call per layer and no mask tensors. The
`to_hf_state_dict` / `from_hf_state_dict` pair converts weights; `tests/training` checks that
the logits match transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim or h // self.heads
        self.eps = config.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        y = F.rms_norm(x, x.shape[-1:], self.attn_norm, self.eps)
        q, k, v = self.qkv(y).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        gqa = self.kv_heads != self.heads
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, self.heads * hd))
        y = F.rms_norm(x, x.shape[-1:], self.mlp_norm, self.eps)
        gate, up = self.gate_up(y).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LeanLlama(nn.Module):
    """Decoder-only Llama; `forward(ids)` returns logits for every position."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if not config.tie_word_embeddings:
            raise ValueError("LeanLlama supports tied embeddings only")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        theta = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        pos = torch.arange(ids.shape[1], dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = F.rms_norm(x, x.shape[-1:], self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.embed.weight)

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) weights, residual output projections scaled by 1/sqrt(2 layers)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        out_std = std / (2 * len(self.layers)) ** 0.5
        for name, p in self.named_parameters():
            with torch.no_grad():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    small = name.endswith(("o.weight", "down.weight"))
                    p.normal_(0.0, out_std if small else std, generator=gen)


def to_hf_state_dict(model: LeanLlama) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed.weight.detach()}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        hd = layer.head_dim
        q, k, v = layer.qkv.weight.detach().split(
            [layer.heads * hd, layer.kv_heads * hd, layer.kv_heads * hd]
        )
        gate, up = layer.gate_up.weight.detach().chunk(2)
        sd |= {
            p + "input_layernorm.weight": layer.attn_norm.detach(),
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.o.weight.detach(),
            p + "post_attention_layernorm.weight": layer.mlp_norm.detach(),
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.down.weight.detach(),
        }
    sd["model.norm.weight"] = model.norm.detach()
    return {k: v.contiguous() for k, v in sd.items()}


def from_hf_state_dict(model: LeanLlama, sd: dict[str, torch.Tensor]) -> None:
    """Load transformers LlamaForCausalLM weights (tied embeddings) into `model`."""
    with torch.no_grad():
        model.embed.weight.copy_(sd["model.embed_tokens.weight"])
        model.norm.copy_(sd["model.norm.weight"])
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            qkv = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            layer.qkv.weight.copy_(torch.cat(qkv))
            layer.o.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            layer.attn_norm.copy_(sd[p + "input_layernorm.weight"])
            layer.mlp_norm.copy_(sd[p + "post_attention_layernorm.weight"])
            gate_up = [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
            layer.gate_up.weight.copy_(torch.cat(gate_up))
            layer.down.weight.copy_(sd[p + "mlp.down_proj.weight"])
