"""Load a model from a local Hugging Face folder (config + safetensors) or a GGUF file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from common.gguf_file import find_gguf, iter_gguf_tensors
from common.model_config import ModelConfig, ModelLoadError
from services.worker.models.llama import LlamaForCausalLM, pack_linear_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig, device: str) -> torch.dtype:
    if name == "auto":
        name = cfg.torch_dtype.replace("torch.", "")
        # Half precision matmuls are slow on most CPUs; serve checkpoint weights in float32 there.
        if torch.device(device).type == "cpu":
            name = "float32"
    if name not in DTYPES:
        raise ModelLoadError(
            f"unsupported dtype {name!r}; choose auto, float32, bfloat16 or float16"
        )
    return DTYPES[name]


def check_model_folder(folder: str | Path) -> Path:
    """Fail early, with one message that names what is missing. Returns the folder, or the
    GGUF file that `folder` names (which carries its own config and tokenizer)."""
    path = Path(folder)
    gguf = find_gguf(path)
    if gguf is not None:
        return gguf
    if path.suffix == ".gguf" and not path.exists():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer.json")
    if missing:
        raise ModelLoadError(f"model folder {path} is missing {', '.join(missing)}")
    return path


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(f"model folder {folder} is missing weight shards {missing}")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def _iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) from safetensors, or dequantized from a GGUF file."""
    if folder.suffix == ".gguf":
        for name, values in iter_gguf_tensors(folder):
            yield name, torch.from_numpy(values)
        return
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def load_model(
    folder: str | Path, dtype: torch.dtype, device: str, max_positions: int
) -> LlamaForCausalLM:
    folder = check_model_folder(folder)
    cfg = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    weights = dict(_iter_tensors(folder))
    state: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise ModelLoadError(f"weights in {folder} lack tensor {name!r}")
        return weights.pop(name)

    state["embed_tokens"] = take("model.embed_tokens.weight")
    state["norm"] = take("model.norm.weight")
    if not cfg.tie_word_embeddings:
        state["lm_head"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        state[f"layers.{i}.input_norm"] = take(p + "input_layernorm.weight")
        state[f"layers.{i}.post_attn_norm"] = take(p + "post_attention_layernorm.weight")
        state[f"layers.{i}.qkv_proj"] = torch.cat(
            [take(attn + f"{n}_proj.weight") for n in ("q", "k", "v")]
        )
        if cfg.attention_bias:
            state[f"layers.{i}.qkv_bias"] = torch.cat(
                [take(attn + f"{n}_proj.bias") for n in ("q", "k", "v")]
            )
        if cfg.qk_norm:
            state[f"layers.{i}.q_norm"] = take(attn + "q_norm.weight")
            state[f"layers.{i}.k_norm"] = take(attn + "k_norm.weight")
        state[f"layers.{i}.o_proj"] = take(attn + "o_proj.weight")
        state[f"layers.{i}.gate_up_proj"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        state[f"layers.{i}.down_proj"] = take(p + "mlp.down_proj.weight")
    # A tied checkpoint may still carry lm_head.weight; anything else left over is unexpected.
    weights.pop("lm_head.weight", None)
    leftover = [n for n in weights if "rotary_emb" not in n]
    if leftover:
        raise ModelLoadError(f"unexpected tensors in {folder}: {leftover[:5]}")

    model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, assign=True)
    model.init_rope(max_positions, device)
    if use_onednn(device, dtype):
        pack_linear_weights(model)
    return model.eval()


def use_onednn(device: str, dtype: torch.dtype) -> bool:
    """oneDNN linears on CPU in float32, unless STOKER_CPU_ONEDNN=0."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and os.environ.get("STOKER_CPU_ONEDNN", "1") != "0"
    )
