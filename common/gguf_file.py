"""Read GGUF files: the model config from the metadata, and tensors dequantized under HF names.

A `.gguf` file (or a folder holding exactly one, and no config.json) is served like a Hugging
Face folder: `config_from_gguf` gives the config.json fields `ModelConfig.from_dict` reads, and
`iter_gguf_tensors` yields float32 arrays named as the HF checkpoint names them, so the loader
has one path for both. numpy only (no torch), so the scheduler and tokenizers can read configs.

llama.cpp's converter permutes the q/k rows of Llama-architecture checkpoints (for its rotary
layout); they are permuted back here, as transformers' own GGUF loader does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from stoker.common.errors import ModelLoadError

# GGUF architectures served, and the Hugging Face class each becomes.
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFError(ModelLoadError):
    """The GGUF file cannot be served; the message names the architecture or tensor type."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only `.gguf` in a folder that has no
    config.json. None for anything else (a Hugging Face folder, a missing path)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path} holds {len(files)} .gguf files; name one of them")
        if files:
            return files[0]
    return None


@functools.lru_cache(maxsize=4)
def _reader(path: Path):  # noqa: ANN202 - gguf is imported lazily (only GGUF users pay for it)
    """One parse per file and process (2.7 s for SmolLM2's 49k-token vocabulary): a load reads
    the config more than once (runner, loader) and then the tensors."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: say which
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(reader: Any, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise GGUFError(f"GGUF architecture {arch!r} in {path} is not supported ({supported})")
    return arch


def config_from_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json fields, generation_config.json fields) from the file's metadata."""
    path = Path(path)
    reader = _reader(path)
    arch = _architecture(reader, path)
    hf_class, model_type = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{path} carries rope_freqs (llama3 rope scaling), not supported in GGUF")
    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": int(num_heads),
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": int(meta("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",  # dequantized on load
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    generation = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
    return config, generation


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFError(f"unexpected GGUF tensor {name!r}")


def _unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, its converter interleaved the two rotary
    halves (rows 0, d/2, 1, d/2+1, ...); HF's layout keeps the halves apart."""
    dim = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, dim, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def iter_gguf_tensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array in HF's [out, in] layout) for every tensor."""
    from gguf import dequantize

    path = Path(path)
    reader = _reader(path)
    arch = _architecture(reader, path)
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in GGUF_TENSOR_TYPES:
            supported = ", ".join(GGUF_TENSOR_TYPES)
            raise GGUFError(
                f"GGUF tensor {tensor.name!r} in {path} is {kind}; stoker reads {supported}"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        values = values.reshape(shape)
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only file map
            values = values.copy()
        if arch == "llama" and ".attn_q." in tensor.name:
            values = _unpermute(values, num_heads)
        elif arch == "llama" and ".attn_k." in tensor.name:
            values = _unpermute(values, num_kv_heads)
        yield _hf_name(tensor.name), values
