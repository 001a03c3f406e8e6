"""Write a GGUF file from a small Hugging Face folder (tests/factory.py), as llama.cpp's
converter lays it out: GGUF tensor names, q/k rows permuted for the Llama architecture, 2-D
weights in the chosen tensor type, 1-D norms in F32, and the tokenizer in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
from safetensors.numpy import load_file

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (the inverse of what the loaders undo)."""
    dim = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, dim, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _tokenizer_metadata(writer: GGUFWriter, folder: Path) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(False)
    template = folder / "chat_template.jinja"  # transformers 5 saves the template apart
    chat = template.read_text() if template.is_file() else config.get("chat_template")
    if chat:
        writer.add_chat_template(chat)


def write_gguf(folder: str | Path, out: str | Path, weight_type: str = "Q8_0") -> Path:
    """GGUF file `out` holding the model in `folder`, its 2-D weights stored as `weight_type`
    (F32, F16, BF16, Q8_0, Q4_0, Q4_1)."""
    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = GGUFWriter(str(out), arch)
    writer.add_name(folder.name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    _tokenizer_metadata(writer, folder)

    qtype = GGMLQuantizationType[weight_type]
    for name, values in load_file(str(folder / "model.safetensors")).items():
        values = values.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            values = _permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = _permute(values, kv_heads)
        if values.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), values)
        else:
            # Quantized rows are bytes; the writer derives the element shape from them.
            writer.add_tensor(_gguf_name(name), quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
