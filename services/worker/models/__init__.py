"""Model implementations by kind (common/model_config.py's SUPPORTED_ARCHITECTURES values)."""

from __future__ import annotations

from stoker.common.model_config import ModelConfig
from stoker.services.worker.models.gemma import GemmaForCausalLM
from stoker.services.worker.models.layers import CausalLM
from stoker.services.worker.models.llama import LlamaForCausalLM
from stoker.services.worker.models.moe import MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,  # a Llama with fused checkpoint tensors and partial rotary
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "qwen3_moe": MoeForCausalLM,
    "mixtral": MoeForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return MODEL_CLASSES[cfg.kind]
