"""Load a model's tokenizer from a Hugging Face folder or from a GGUF file's metadata."""

from __future__ import annotations

import json
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


def chat_template_text(model: str | Path) -> str | None:
    """The model's chat template text, without transformers (the api reads it to detect the
    tool-call format): chat_template.jinja, which transformers prefers when both exist, else
    tokenizer_config.json's `chat_template`, or the GGUF's `tokenizer.chat_template`. Of named
    templates (a list of {name, template}), the tool one where there is one, as transformers
    picks it for a request with tools."""
    gguf = find_gguf(model)
    if gguf is not None:
        from stoker.common.gguf_file import _field, _reader

        text = _field(_reader(gguf), "tokenizer.chat_template")
        return str(text) if text else None
    folder = Path(model)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("tokenizer_config.json", "chat_template.json"):  # the latter: processors'
        path = folder / name
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if template:
                return _pick_template(template)
    return None


def _pick_template(template: str | list[dict[str, Any]]) -> str | None:
    if isinstance(template, str):
        return template
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    return named.get("tool_use") or named.get("default") or next(iter(named.values()), None)
