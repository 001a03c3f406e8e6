"""Mixture of experts: Qwen3-MoE (q/k norm, optional renormalised top-k, dense layers by
`mlp_only_layers` / `decoder_sparse_step`) and Mixtral (renormalised top-k). The attention and
the layer are Llama's; the MLP is a router over `num_experts` gated MLPs, k per token.

Expert compute is batched per expert, never per token: the (token, slot) pairs are sorted by
expert, so each expert runs one matmul pair over its contiguous run of rows, and the weighted
rows are summed back per token with one index_add_. Routing as transformers does it: softmax in
float32 over all experts, top-k, optional renormalisation, weights cast back to the dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stoker.common.model_config import ModelConfig
from stoker.services.worker.models.layers import CausalLM, activation, param
from stoker.services.worker.models.llama import DecoderLayer


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = param(experts, hidden)
        self.gate_up_proj = param(experts, 2 * inter, hidden)  # per expert [gate; up]
        self.down_proj = param(experts, hidden, inter)
        self.act = activation(cfg.hidden_act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._dense(x, weights, experts)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        rows = x[tokens]
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                out[start:end] = self._expert(rows[start:end], expert)
                start = end
        out *= weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[expert])

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight (zero where not routed):
        no host sync, so it can be captured in a CUDA graph (decode batches are small)."""
        out = torch.zeros_like(x)
        for expert in range(self.gate_up_proj.shape[0]):
            weight = (weights * (experts == expert)).sum(dim=-1, keepdim=True)
            out += self._expert(x, expert) * weight
        return out


class MoeForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        # Dense layers of an MoE model keep the gated MLP at intermediate_size.
        sparse = bool(cfg.moe_layers) and cfg.moe_layers[layer]
        return DecoderLayer(cfg, layer, SparseMoE(cfg) if sparse else None)
