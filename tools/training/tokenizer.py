"""Byte-level BPE tokenizer (HF `tokenizers`), saved in the standard transformers layout."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2

# Conversations are rendered in the corpus's own play format: "User.\n<speech>\n\nAssistant.\n"
# (newlines are Jinja string literals because transformers renders with trim_blocks=True).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}{{ '.\\n' }}{{ message['content'] | trim }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant.\\n' }}{% endif %}"
)

# Files that make up a tokenizer folder; `copy_tokenizer_files` copies whichever exist.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE; encoding adds <|bos|> in front (like Llama)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {name: tok.token_to_id(t) for name, t in (("bos", BOS), ("eos", EOS), ("pad", PAD))}
    if any(v is None for v in ids.values()):
        raise ValueError(f"tokenizer lacks a special token: {ids}")
    return ids  # type: ignore[return-value]


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """CHAT_TEMPLATE rendered with jinja2, as transformers does (for building training text)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS
    )
