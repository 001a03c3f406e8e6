"""Small Llama models: building from a size spec, and saving as a standard HF folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PretrainedConfig


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


def dtype_of(config: PretrainedConfig) -> torch.dtype:
    """The checkpoint dtype a config declares (float32 when absent or unusual)."""
    d = getattr(config, "dtype", None) or torch.float32
    d = getattr(torch, d.replace("torch.", "")) if isinstance(d, str) else d
    return d if d in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round the parameters to `dtype` (kept in float32): evaluate exactly what is shipped."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())


def save_model(
    config: LlamaConfig, state_dict: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype
) -> None:
    """config.json + model.safetensors + generation_config.json, weights cast to `dtype`.

    `state_dict` uses transformers' LlamaForCausalLM names; lm_head.weight may be absent
    (tied embeddings).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    model = LlamaForCausalLM._from_config(config, dtype=dtype)
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise ValueError(f"state dict does not fit the config: {result}")
    model.config.dtype = dtype
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
