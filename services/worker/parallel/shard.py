"""Which slice of each checkpoint tensor a rank keeps: Megatron's layout, as pure functions.

- column parallel (output rows split): the fused q/k/v projection (q by query heads, k and v by
  KV heads), the fused gate/up projection (gate and up halves each split), expert gate/up;
- row parallel (input columns split, outputs summed by one all-reduce): o_proj, down_proj and
  the experts' down projections;
- vocab parallel: embedding and LM head rows, padded to a multiple of the rank count;
- everything else (norms, q/k norms, MoE routers) replicated.

KV heads: with at least as many KV heads as ranks each rank takes num_kv / size of them; with
fewer, each KV head is replicated over size / num_kv ranks, so a rank's query heads always find
their own group's K/V locally (rank r keeps head r * num_kv // size).
"""

from __future__ import annotations

import dataclasses

import torch

from stoker.common.model_config import ModelConfig, ModelLoadError


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def part(self, n: int) -> slice:
        """This rank's contiguous 1/size of n (n divisible by size)."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> slice:
        if num_kv_heads >= self.size:
            return self.part(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return slice(head, head + 1)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank): the last rank's tail is zero padding."""
        per = -(-vocab_size // self.size)
        return self.rank * per, per


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    return max(1, num_kv_heads // size)


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse, naming the dimension, a model that does not split evenly over `size` ranks."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads")
    sparse = cfg.moe_layers
    some_dense = not sparse or not all(sparse)
    if some_dense and cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if any(sparse) and cfg.moe_intermediate_size % size:
        problems.append(f"expert intermediate size {cfg.moe_intermediate_size}")
    if problems:
        raise ModelLoadError(
            f"tensor_parallel_size {size} does not divide the model's {', '.join(problems)}"
        )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shapes the model is built with (vocab stays whole: logits are gathered)."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=local_kv_heads(cfg.num_kv_heads, size),
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size,
    )


def shard_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, shard: Shard
) -> dict[str, torch.Tensor]:
    """The full fused state (loader.py's names) -> this rank's tensors, each its own copy."""
    heads, kv_heads = shard.part(cfg.num_heads), shard.kv_heads(cfg.num_kv_heads)
    out = {}
    for name, tensor in state.items():
        leaf = name.rsplit(".", 1)[-1]
        if name in ("embed_tokens", "lm_head"):
            tensor = vocab_shard(tensor, shard)
        elif leaf in ("qkv_proj", "qkv_bias"):
            tensor = qkv_shard(tensor, cfg, heads, kv_heads)
        elif leaf == "o_proj":  # [hidden, heads * head_dim]: the columns of this rank's heads
            tensor = _heads(tensor.T, cfg.head_dim, heads).T
        elif leaf == "gate_up_proj":  # [..., 2 * inter, hidden]: each half split alike
            gate, up = tensor.chunk(2, dim=-2)
            rows = shard.part(gate.shape[-2])
            tensor = torch.cat([gate[..., rows, :], up[..., rows, :]], dim=-2)
        elif leaf == "down_proj":  # [..., hidden, inter]
            tensor = tensor[..., shard.part(tensor.shape[-1])]
        out[name] = tensor.clone(memory_format=torch.contiguous_format)
    return out


def qkv_shard(
    tensor: torch.Tensor, cfg: ModelConfig, heads: slice, kv_heads: slice
) -> torch.Tensor:
    """Rows [q; k; v] of a fused projection weight or bias -> this rank's [q; k; v]."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = tensor.split([q_size, kv_size, kv_size])
    d = cfg.head_dim
    return torch.cat([_heads(q, d, heads), _heads(k, d, kv_heads), _heads(v, d, kv_heads)])


def vocab_shard(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    first, per = shard.vocab_rows(tensor.shape[0])
    rows = tensor[first : first + per]
    if rows.shape[0] < per:
        pad = rows.new_zeros((per - rows.shape[0], *rows.shape[1:]))
        rows = torch.cat([rows, pad])
    return rows


def _heads(tensor: torch.Tensor, head_dim: int, heads: slice) -> torch.Tensor:
    """Rows of the heads in `heads`, for a tensor whose rows are head after head."""
    rows = slice(heads.start * head_dim, heads.stop * head_dim)
    return tensor[rows]
