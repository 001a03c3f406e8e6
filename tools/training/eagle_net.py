"""The EAGLE head for training: the worker's head (services/worker/eagle/head.py) in plain torch,
same parameter names, with EAGLE-3's training-time test.

Training-time test: step 0 runs the head on every position with the target's features; step j
runs it again with the head's own step j - 1 outputs (shifted one position) as features, so
row p at step j is the j-th draft of a chain that started at position s = p - j. Its attention
sees what it would see at inference: the step-0 rows up to s (true features) and, at each step
i in 1..j, the single chain row at position s + i. Every step is one batched pass, so training
all k draft positions costs k head forwards, not k * T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stoker.kernels.rotary import rope_cos_sin, rope_inv_freq
from stoker.services.worker.eagle.config import EagleConfig

KV = tuple[torch.Tensor, torch.Tensor]  # [B, Hkv, T, D] keys and values of one step


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """x moved n positions later along dim (zeros in front): out[p] = x[p - n]."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - n)], dim=dim)


def _weight(*shape: int, gen: torch.Generator) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen) / math.sqrt(shape[-1]))


def _ones(n: int) -> nn.Parameter:
    return nn.Parameter(torch.ones(n))


class _Attn(nn.Module):
    def __init__(self, cfg: EagleConfig, gen: torch.Generator) -> None:
        super().__init__()
        c = cfg.layer_cfg
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = _weight(q + 2 * kv, c.hidden_size, gen=gen)
        self.o_proj = _weight(c.hidden_size, q, gen=gen)
        with torch.no_grad():
            self.o_proj.mul_(0.5)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], history: list[KV]
    ) -> torch.Tensor:
        """x [B, T, hidden]; history: this layer's (k, v) at steps 0 .. j - 1; appends step j's."""
        B, T, _ = x.shape
        H, Hk, D = self.heads, self.kv_heads, self.head_dim
        q, k, v = F.linear(x, self.qkv_proj).split([H * D, Hk * D, Hk * D], dim=-1)
        q = _rotate(q.view(B, T, H, D).transpose(1, 2), *rope)
        k = _rotate(k.view(B, T, Hk, D).transpose(1, 2), *rope)
        v = v.view(B, T, Hk, D).transpose(1, 2)
        history.append((k, v))
        j = len(history) - 1
        rep = H // Hk
        scale = D**-0.5
        k0, v0 = (t.repeat_interleave(rep, dim=1) for t in history[0])
        scores = [q @ k0.transpose(-1, -2) * scale]  # [B, H, T, T]
        pos = torch.arange(T, device=x.device)
        allowed = pos[None, :] <= pos[:, None] - j  # step-0 keys up to the chain's start
        scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
        values = []
        for i in range(1, j + 1):  # the chain's own row at step i sits j - i positions back
            ki, vi = (_shift(t.repeat_interleave(rep, dim=1), j - i, 2) for t in history[i])
            scores.append((q * ki).sum(-1, keepdim=True) * scale)
            values.append(vi)
        w = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        out = w[..., :T] @ v0
        for n, vi in enumerate(values):
            out = out + w[..., T + n : T + n + 1] * vi
        return F.linear(out.transpose(1, 2).reshape(B, T, H * D), self.o_proj)


class _MLP(nn.Module):
    def __init__(self, cfg: EagleConfig, gen: torch.Generator) -> None:
        super().__init__()
        c = cfg.layer_cfg
        self.gate_up_proj = _weight(2 * c.intermediate_size, c.hidden_size, gen=gen)
        self.down_proj = _weight(c.hidden_size, c.intermediate_size, gen=gen)
        with torch.no_grad():
            self.down_proj.mul_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


class _Layer(nn.Module):
    def __init__(self, cfg: EagleConfig, gen: torch.Generator) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.eps = cfg.layer_cfg.rms_norm_eps
        self.input_norm = _ones(h)
        self.attn = _Attn(cfg, gen)
        self.post_attn_norm = _ones(h)
        self.mlp = _MLP(cfg, gen)

    def forward(self, x, rope, history: list[KV]) -> torch.Tensor:
        x = x + self.attn(_rms(x, self.input_norm, self.eps), rope, history)
        return x + self.mlp(_rms(x, self.post_attn_norm, self.eps))


class EagleNet(nn.Module):
    """Parameters named as the worker's EagleHead's state dict, so saving is a plain copy."""

    d2t: torch.Tensor | None

    def __init__(self, cfg: EagleConfig, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        h = cfg.hidden_size
        self.cfg = cfg
        self.eps = cfg.layer_cfg.rms_norm_eps
        self.fuse = _weight(h, len(cfg.target_layers) * h, gen=gen)
        self.embed_norm = _ones(h)
        self.feature_norm = _ones(h)
        self.in_proj = _weight(h, 2 * h, gen=gen)
        self.layers = nn.ModuleList(_Layer(cfg, gen) for _ in range(cfg.num_layers))
        self.norm = _ones(h)
        c = cfg.layer_cfg
        cos, sin = rope_cos_sin(
            rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling), c.max_position_embeddings
        )
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if cfg.draft_vocab_size:  # saved with the head: draft index -> target token id
            self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size))
        else:
            self.d2t = None

    def unroll(self, embeds: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """embeds [B, T, h] (the target's embedding of each position's token), taps [B, T,
        layers * h] (the target's tapped outputs there). Returns per step j the normed output
        [B, T, h]; row p of step j predicts token p + 1 as the j-th draft from s = p - j."""
        T = embeds.shape[1]
        rope = (self.cos[:T].to(embeds.dtype), self.sin[:T].to(embeds.dtype))
        feature = _shift(F.linear(taps, self.fuse), 1, 1)  # row p reads position p - 1
        e = _rms(embeds, self.embed_norm, self.eps)
        histories: list[list[KV]] = [[] for _ in self.layers]
        outs = []
        for _ in range(steps):
            x = F.linear(
                torch.cat([e, _rms(feature, self.feature_norm, self.eps)], -1), self.in_proj
            )
            for layer, history in zip(self.layers, histories):
                x = layer(x, rope, history)
            outs.append(_rms(x, self.norm, self.eps))
            feature = _shift(x, 1, 1)  # the next draft reads this one's output stream
        return outs

    def head_state(self) -> dict[str, torch.Tensor]:
        """Float tensors as float32; d2t stays int64."""
        return {
            k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous()
            for k, v in self.state_dict().items()
        }
