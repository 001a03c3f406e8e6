"""Small Llama models: building from a size spec, and saving as a standard HF folder."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class LlamaSize:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def llama_config(
    size: LlamaSize,
    vocab_size: int,
    max_len: int,
    bos_id: int | None,
    eos_id: int | None,
    pad_id: int | None,
    dtype: str = "float32",
) -> LlamaConfig:
    if size.hidden % size.heads or size.heads % size.kv_heads:
        raise ValueError(f"heads must divide hidden and kv_heads must divide heads: {size}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype=dtype,
    )


def build_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised model (fp32, sdpa attention), deterministic given `seed`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    # GPT-2 style: scale the init of the residual-branch output projections by 1/sqrt(2 L).
    std = config.initializer_range / (2 * config.num_hidden_layers) ** 0.5
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.o_proj.weight, std=std)
        torch.nn.init.normal_(layer.mlp.down_proj.weight, std=std)
    return model


def size_of(config: LlamaConfig) -> LlamaSize:
    heads = config.num_attention_heads
    return LlamaSize(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=config.num_key_value_heads or heads,
    )


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_model(
    model: LlamaForCausalLM, out_dir: Path, dtype: torch.dtype, extra_config: dict | None = None
) -> None:
    """config.json + model.safetensors + generation_config.json, weights cast to `dtype`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = LlamaForCausalLM._from_config(model.config, dtype=dtype)
    copy.load_state_dict(model.state_dict())
    copy.config.dtype = dtype
    copy.config.use_cache = True
    copy.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    )
    copy.save_pretrained(out_dir, safe_serialization=True)
    if extra_config:
        path = out_dir / "config.json"
        config = json.loads(path.read_text())
        config.update(extra_config)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
