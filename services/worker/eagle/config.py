"""An EAGLE head's folder: config.json (architectures ["EagleHead"], the target layers it reads,
Llama-style shapes of its own decoder layers, and `draft_vocab_size` when it drafts from a
reduced vocabulary) and model.safetensors (the head's own weights, and then `d2t`: the target
ids of its draft vocabulary; the embedding and LM head are the target's, never stored here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stoker.common.model_config import ModelConfig, ModelLoadError

ARCHITECTURE = "EagleHead"
WEIGHTS = "model.safetensors"


def is_eagle_head(folder: str | Path) -> bool:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return ARCHITECTURE in (raw.get("architectures") or [])


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high layers, as EAGLE-3 picks them (outputs of layers 2, L/2, L-3 in
    transformers' hidden_states numbering, i.e. decoder layers 1, L/2 - 1, L - 4)."""
    picks = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(sorted({min(max(p, 0), num_layers - 1) for p in picks}))


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    target_layers: tuple[int, ...]  # decoder layers whose outputs are fused
    layer_cfg: ModelConfig  # the shapes of the head's own decoder layers (Llama-style)
    raw: dict[str, Any]

    @property
    def hidden_size(self) -> int:
        return self.layer_cfg.hidden_size

    @property
    def num_layers(self) -> int:
        return self.layer_cfg.num_layers

    @property
    def draft_vocab_size(self) -> int:
        """0: the head drafts over the target's whole vocabulary. Otherwise over this many of
        its tokens (EAGLE-3's reduced vocabulary: the LM head's rows for the tokens the target
        emits most), which cuts the biggest cost of a draft step, the LM head."""
        return int(self.raw.get("draft_vocab_size") or 0)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EagleConfig:
        layers = tuple(int(i) for i in raw.get("target_layers") or ())
        if not layers:
            raise ModelLoadError("EAGLE head config lacks target_layers")
        # The head's layers are plain Llama layers whatever the target's family is.
        layer_raw = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        return cls(layers, ModelConfig.from_dict(layer_raw), raw)

    @classmethod
    def from_folder(cls, folder: str | Path) -> EagleConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"EAGLE head folder {folder} has no config.json")
        if not (Path(folder) / WEIGHTS).is_file():
            raise ModelLoadError(f"EAGLE head folder {folder} has no {WEIGHTS}")
        return cls.from_dict(json.loads(path.read_text()))

    def check_target(self, target: ModelConfig, folder: str | Path) -> None:
        """The head reuses the target's embedding and LM head and reads its layers."""
        if self.layer_cfg.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"EAGLE head {folder} has vocab {self.layer_cfg.vocab_size}, the target "
                f"{target.vocab_size}: a head is trained for one target"
            )
        if self.hidden_size != target.hidden_size:
            raise ModelLoadError(
                f"EAGLE head {folder} has hidden size {self.hidden_size}, the target "
                f"{target.hidden_size}: a head is trained for one target"
            )
        if not 0 <= self.draft_vocab_size <= target.vocab_size:
            raise ModelLoadError(
                f"EAGLE head {folder} has a draft vocabulary of {self.draft_vocab_size}, more "
                f"than the target's {target.vocab_size} tokens"
            )
        bad = [i for i in self.target_layers if not 0 <= i < target.num_layers]
        if bad:
            raise ModelLoadError(
                f"EAGLE head {folder} reads layers {bad}; the target has {target.num_layers}"
            )


def head_config_dict(
    target: dict[str, Any],
    target_layers: tuple[int, ...],
    num_layers: int = 1,
    draft_vocab_size: int = 0,
) -> dict[str, Any]:
    """A head's config.json from its target's: the target's attention shapes and rope, so the
    head's KV lines up with the target's positions. draft_vocab_size 0: the whole vocabulary."""
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "hidden_act",
    )
    raw = {k: target[k] for k in keys if target.get(k) is not None}
    if target.get("model_type") in ("gemma2", "gemma3"):
        raw["hidden_act"] = "gelu_pytorch_tanh"
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "eagle_head",
        "target_layers": list(target_layers),
        "num_hidden_layers": num_layers,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        **raw,
        **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {}),
    }
