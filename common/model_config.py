"""Parse a Hugging Face `config.json` into the few numbers the models need.

Read by the worker, the scheduler and the tokenizers, so it imports nothing heavy (no torch)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stoker.common.errors import ModelLoadError

# Hugging Face architecture -> kind; services/worker/models/__init__.py maps each kind to its
# implementation (Llama, Mistral, Qwen2 and Qwen3 share one; the differences are flags below).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # text-only Gemma 3 (model_type gemma3_text)
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# Kinds whose `sliding_window` only counts with `use_sliding_window` (and then, unless
# `layer_types` says otherwise, from layer `max_window_layers` on; MoE: every layer).
_OPT_IN_WINDOW = {"qwen2": 28, "qwen3": 28, "qwen3_moe": 0}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")


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
    kind: str = "llama"  # SUPPORTED_ARCHITECTURES' value: picks the implementation
    # Per layer: the sliding window, or None for global attention (empty: all global).
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # Phi-3: rotary on the first head_dim * factor dims
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores
    final_softcap: float | None = None  # Gemma 2/3: tanh soft-capping of the logits
    local_rope_theta: float | None = None  # Gemma 3: rope base of the sliding-window layers
    # Mixture of experts (Qwen3-MoE, Mixtral): top-k of num_experts per token on `moe_layers`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """From a Hugging Face folder, or a GGUF file (or a folder holding one)."""
        from stoker.common.gguf_file import config_from_gguf, find_gguf

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
        num_layers = raw["num_hidden_layers"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, scaling, local_theta, partial = _rope(raw, kind)
        windows = _layer_windows(raw, kind, num_layers)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {act!r}")
        if raw.get("use_bidirectional_attention"):
            raise ModelLoadError("bidirectional attention (embedding Gemma) is not supported")
        gemma = kind in ("gemma2", "gemma3")
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        sparse_step = int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(
            num_experts > 0 and i not in dense and (i + 1) % sparse_step == 0
            for i in range(num_layers)
        )
        generation = generation or {}
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            attention_bias=bool(raw.get("attention_bias", kind == "qwen2")),
            qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=max((w for w in windows if w), default=None),
            eos_token_ids=eos_ids,
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            kind=kind,
            layer_windows=windows if any(windows) else (),
            hidden_act=act,
            partial_rotary_factor=partial,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if gemma else None,
            attn_softcap=raw.get("attn_logit_softcapping") if kind == "gemma2" else None,
            final_softcap=raw.get("final_logit_softcapping") if gemma else None,
            local_rope_theta=local_theta,
            num_experts=num_experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(
                raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0
            ),
            norm_topk_prob=bool(raw.get("norm_topk_prob", kind == "mixtral")),
            moe_layers=moe_layers if any(moe_layers) else (),
        )


def _rope(
    raw: dict[str, Any], kind: str
) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(rope_theta, scaling or None, the local layers' theta (Gemma 3) or None, partial factor).
    transformers 5 writes `rope_parameters` (per layer type for Gemma 3); 4.x writes
    `rope_theta` + `rope_scaling` (+ `rope_local_base_freq`, `partial_rotary_factor`)."""
    params = dict(raw.get("rope_parameters") or {})
    local_theta = None
    if kind == "gemma3":
        local = params.get("sliding_attention") or {}
        params = dict(params.get("full_attention") or params)
        local_theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0)
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError("rope scaling on Gemma 3's sliding-window layers is not supported")
    default_theta = 1_000_000.0 if kind == "gemma3" else 10000.0
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or default_theta)
    partial = float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1)
    scaling = raw.get("rope_scaling") or params or None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type in ("default", None):
            scaling = None
        elif rope_type not in ("llama3", "linear"):
            raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}")
    return theta, scaling, local_theta, partial


def _layer_windows(raw: dict[str, Any], kind: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global attention), as transformers assigns them."""
    window = raw.get("sliding_window")
    if kind in _OPT_IN_WINDOW and not raw.get("use_sliding_window"):
        window = None
    if not window:
        return (None,) * num_layers
    types = raw.get("layer_types")
    if types is None and kind in ("gemma2", "gemma3"):  # every `pattern`-th layer is global
        pattern = 2 if kind == "gemma2" else int(raw.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full" for i in range(num_layers)]
    elif types is None and kind in _OPT_IN_WINDOW:
        first = int(raw.get("max_window_layers", _OPT_IN_WINDOW[kind]))
        types = ["sliding_attention" if i >= first else "full" for i in range(num_layers)]
    elif types is None:  # Mistral, Mixtral, Phi-3: every layer
        types = ["sliding_attention"] * num_layers
    if kind == "qwen3_moe":  # transformers' Qwen3-MoE windows every layer whatever layer_types says
        types = ["sliding_attention"] * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types[:num_layers])


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The longest sequence served: the model's limit, or the smaller `requested`. One rule for
    the worker and the tokenizers (which validate prompt lengths without loading the model)."""
    limit = cfg.max_position_embeddings  # sliding windows are attended in full: no cap
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit {limit}")
    return requested
