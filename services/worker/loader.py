"""Load a model from a local Hugging Face folder (config + safetensors) or a GGUF file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from stoker.common.gguf_file import find_gguf, iter_gguf_tensors
from stoker.common.model_config import ModelConfig, ModelLoadError
from stoker.kernels import cpu_ops
from stoker.services.worker.models import model_class
from stoker.services.worker.models.layers import CausalLM, pack_linear_weights
from stoker.services.worker.models.llama import enable_native_layers
from stoker.services.worker.parallel.comm import Communicator
from stoker.services.worker.parallel.layers import parallelize
from stoker.services.worker.parallel.shard import check_divisible, shard_config, shard_state

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
    folder: str | Path,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    comm: Communicator | None = None,
) -> CausalLM:
    """comm: this rank's share of a tensor-parallel model (services/worker/parallel/)."""
    folder = check_model_folder(folder)
    cfg = ModelConfig.from_folder(folder)
    if comm is not None:
        check_divisible(cfg, comm.world_size)
    with torch.device("meta"):
        if comm is None:
            model = model_class(cfg)(cfg)
        else:
            model = model_class(cfg)(shard_config(cfg, comm.world_size))
            parallelize(model, comm, cfg.vocab_size)
    weights = dict(_iter_tensors(folder))
    state = _Checkpoint(weights, folder).state(cfg)
    if comm is not None:
        state = shard_state(state, cfg, comm.shard)
    # A tied checkpoint may still carry lm_head.weight; anything else left over is unexpected.
    weights.pop("lm_head.weight", None)
    leftover = [n for n in weights if "rotary_emb" not in n]
    if leftover:
        raise ModelLoadError(f"unexpected tensors in {folder}: {leftover[:5]}")

    model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, assign=True)
    model.init_rope(max_positions, device)
    if packs_linear_weights(device, dtype):
        pack_linear_weights(model)
    enable_native_layers(model, torch.device(device), dtype)
    return model.eval()


class _Checkpoint:
    """Hugging Face tensor names -> the model's fused state, per family. Tensors are popped as
    they are taken, so whatever is left over afterwards was not expected."""

    def __init__(self, weights: dict[str, torch.Tensor], folder: Path) -> None:
        self.weights, self.folder = weights, folder

    def take(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise ModelLoadError(f"weights in {self.folder} lack tensor {name!r}")
        return self.weights.pop(name)

    def cat(self, *names: str) -> torch.Tensor:
        return torch.cat([self.take(n) for n in names])

    def norm(self, name: str, cfg: ModelConfig) -> torch.Tensor:
        """Gemma's RMSNorm scales by (1 + w): stored as 1 + w so the plain norm kernels apply."""
        weight = self.take(name)
        return weight.float() + 1.0 if cfg.kind in ("gemma2", "gemma3") else weight

    def state(self, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        state = {
            "embed_tokens": self.take("model.embed_tokens.weight"),
            "norm": self.norm("model.norm.weight", cfg),
        }
        if not cfg.tie_word_embeddings:
            state["lm_head"] = self.take("lm_head.weight")
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            state[ours + "input_norm"] = self.norm(hf + "input_layernorm.weight", cfg)
            state[ours + "post_attn_norm"] = self.norm(hf + "post_attention_layernorm.weight", cfg)
            if cfg.kind in ("gemma2", "gemma3"):
                state[ours + "pre_ff_norm"] = self.norm(
                    hf + "pre_feedforward_layernorm.weight", cfg
                )
                state[ours + "post_ff_norm"] = self.norm(
                    hf + "post_feedforward_layernorm.weight", cfg
                )
            state.update(self._attention(cfg, hf + "self_attn.", ours + "attn."))
            if cfg.moe_layers and cfg.moe_layers[i]:
                state.update(self._experts(cfg, hf, ours + "mlp."))
            else:
                state.update(self._mlp(cfg, hf + "mlp.", ours + "mlp."))
        return state

    def _attention(self, cfg: ModelConfig, hf: str, ours: str) -> dict[str, torch.Tensor]:
        if cfg.kind == "phi3":  # fused in the checkpoint already
            state = {ours + "qkv_proj": self.take(hf + "qkv_proj.weight")}
        else:
            state = {ours + "qkv_proj": self.cat(*(hf + f"{n}_proj.weight" for n in "qkv"))}
        if cfg.attention_bias:
            state[ours + "qkv_bias"] = self.cat(*(hf + f"{n}_proj.bias" for n in "qkv"))
        if cfg.qk_norm:
            state[ours + "q_norm"] = self.norm(hf + "q_norm.weight", cfg)
            state[ours + "k_norm"] = self.norm(hf + "k_norm.weight", cfg)
        state[ours + "o_proj"] = self.take(hf + "o_proj.weight")
        return state

    def _mlp(self, cfg: ModelConfig, hf: str, ours: str) -> dict[str, torch.Tensor]:
        if cfg.kind == "phi3":  # [gate; up] fused in the checkpoint already
            gate_up = self.take(hf + "gate_up_proj.weight")
        else:
            gate_up = self.cat(hf + "gate_proj.weight", hf + "up_proj.weight")
        return {
            ours + "gate_up_proj": gate_up,
            ours + "down_proj": self.take(hf + "down_proj.weight"),
        }

    def _experts(self, cfg: ModelConfig, hf: str, ours: str) -> dict[str, torch.Tensor]:
        """Per-expert tensors stacked to [E, 2 * inter, hidden] and [E, hidden, inter]; also
        takes transformers 5's fused 3-D layout (mlp.experts.gate_up_proj / down_proj)."""
        if cfg.kind == "mixtral":
            moe = hf + "block_sparse_moe."
            gate, up, down = "w1", "w3", "w2"
        else:
            moe = hf + "mlp."
            gate, up, down = "gate_proj", "up_proj", "down_proj"
        state = {ours + "router": self.take(moe + "gate.weight")}
        fused = moe + "experts.gate_up_proj"
        if fused in self.weights:
            state[ours + "gate_up_proj"] = self.take(fused)
            state[ours + "down_proj"] = self.take(moe + "experts.down_proj")
            return state
        experts = [f"{moe}experts.{e}." for e in range(cfg.num_experts)]
        state[ours + "gate_up_proj"] = torch.stack(
            [self.cat(e + f"{gate}.weight", e + f"{up}.weight") for e in experts]
        )
        state[ours + "down_proj"] = torch.stack([self.take(e + f"{down}.weight") for e in experts])
        return state


def packs_linear_weights(device: str, dtype: torch.dtype) -> bool:
    """Packed linear weights on CPU (`layers.pack_weight`: a native kernel's layout or oneDNN's)
    in float32, and in bfloat16 where a native kernel takes it (the pair kernel on AVX512-BF16,
    else the panel kernel) or oneDNN has bfloat16 arithmetic (AVX512-BF16 or AMX: packed bf16
    GEMMs ran 1.7-1.9x faster than packed float32 at 1-32 rows on such a box; without it oneDNN
    emulates them). STOKER_CPU_ONEDNN=0 turns both off."""
    if (
        torch.device(device).type != "cpu"
        or not torch.backends.mkldnn.is_available()
        or os.environ.get("STOKER_CPU_ONEDNN", "1") == "0"
    ):
        return False
    if dtype == torch.bfloat16:
        native = cpu_ops.use_bf16_pairs() or cpu_ops.use_panel_linear()
        return native or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32
