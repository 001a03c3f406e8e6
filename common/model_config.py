"""Parse a Hugging Face `config.json` into the few numbers the models need.

Read by the worker, the scheduler and the tokenizers, so it imports nothing heavy (no torch)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Architectures that share one implementation; the differences are flags below.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelLoadError(ValueError):
    """The model folder cannot be served; the message says why."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    qk_norm: bool  # Qwen3 normalises q and k per head
    torch_dtype: str
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """From a Hugging Face folder, or a GGUF file (or a folder holding one)."""
        from common.gguf_file import config_from_gguf, find_gguf

        gguf = find_gguf(folder)
        if gguf is not None:
            return cls.from_dict(*config_from_gguf(gguf))
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"model folder {folder} has no config.json")
        raw = json.loads(path.read_text())
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"stoker supports {supported}"
            )
        kind = SUPPORTED_ARCHITECTURES[arch]
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        # transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` + `rope_scaling`.
        rope_params = dict(raw.get("rope_parameters") or {})
        rope_theta = float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        scaling = raw.get("rope_scaling") or rope_params or None
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type in ("default", None):
                scaling = None
            elif rope_type not in ("llama3", "linear"):
                raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}")
        sliding = raw.get("sliding_window")
        if kind == "qwen2" or kind == "qwen3":
            sliding = sliding if raw.get("use_sliding_window") else None
        generation = generation or {}
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", kind == "qwen2")),
            qk_norm=kind == "qwen3",
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
        )


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The longest sequence served: the model's limit, or the smaller `requested`. One rule for
    the worker and the tokenizers (which validate prompt lengths without loading the model)."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:  # no sliding-window attention: stay inside one window
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit {limit}")
    return requested
