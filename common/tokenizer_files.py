"""Load a model's tokenizer from a Hugging Face folder or from a GGUF file's metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoker.common.gguf_file import find_gguf


def load_tokenizer(model: str | Path) -> Any:
    """A transformers tokenizer (chat template and special tokens included). For GGUF, built
    from the file's metadata by transformers' GGUF converter, as `gguf_file=` does."""
    from transformers import AutoTokenizer

    gguf = find_gguf(model)
    if gguf is not None:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(str(model))


def tokenizer_json(model: str | Path) -> str:
    """The `tokenizers` library's JSON for the model, for processes that only map ids to
    strings (the api): read from tokenizer.json, or built from the GGUF metadata."""
    gguf = find_gguf(model)
    if gguf is None:
        return (Path(model) / "tokenizer.json").read_text()
    return load_tokenizer(gguf).backend_tokenizer.to_str()
