"""The bundled default models (models/stoker-tiny and its draft) work with plain transformers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "stoker-tiny"
DRAFT = REPO / "models" / "stoker-tiny-draft"
PROMPT = "Ham.\nTo be, or not to be, that is the question:\n"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.mark.parametrize("folder", [TARGET, DRAFT], ids=["target", "draft"])
def test_folder_is_complete(folder: Path) -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json", "README.md"):
        assert (folder / name).is_file(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "CORPUS_LICENSE.md"):
        assert (folder / name).is_file(), name


def test_total_size_under_40_mb() -> None:
    total = sum(f.stat().st_size for d in (TARGET, DRAFT) for f in d.iterdir())
    assert total <= 40 * 2**20


def test_target_greedy_text_looks_like_a_play(tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(TARGET).eval()
    assert model.config.model_type == "llama"
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=80, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 20, text
    assert Counter(new).most_common(1)[0][1] <= len(new) // 4, text  # no one-token loop
    assert len(set(words)) >= len(words) // 3, text
    assert sum(c.isalpha() or c.isspace() for c in text) >= 0.8 * len(text), text
    assert "\n" in text, text  # verse lines


def test_draft_shares_tokenizer_and_generates(tokenizer) -> None:
    draft_tok = AutoTokenizer.from_pretrained(DRAFT)
    assert draft_tok.get_vocab() == tokenizer.get_vocab()
    assert (DRAFT / "tokenizer.json").read_bytes() == (TARGET / "tokenizer.json").read_bytes()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT).eval()
    target_config = json.loads((TARGET / "config.json").read_text())
    assert draft.config.num_hidden_layers <= 2
    assert draft.config.vocab_size == target_config["vocab_size"]
    assert (
        draft.num_parameters() < 0.5 * AutoModelForCausalLM.from_pretrained(TARGET).num_parameters()
    )
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = draft.generate(**ids, max_new_tokens=10, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 10


def test_bundled_tokenizer_roundtrip_and_chat_template(tokenizer) -> None:
    for text in ["Héllo wörld — naïve café, 日本語, emoji 🎭!", "Ham.\nTo be,\n\n  or not\tto be"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "Good morrow, sir."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|>User.\nGood morrow, sir.\n\nAssistant.\n"


def test_cards_report_measured_figures() -> None:
    report = json.loads((TARGET / "train_report.json").read_text())
    card = (TARGET / "README.md").read_text()
    assert f"**{report['val_perplexity']:.2f}**" in card
    draft = json.loads((DRAFT / "distill_report.json").read_text())
    assert draft["agreement_text"] >= 0.6
    assert f"**{100 * draft['agreement_text']:.1f}%**" in (DRAFT / "README.md").read_text()
