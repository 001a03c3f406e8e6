"""Corpus preparation and the byte-level BPE tokenizer with its chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from stoker.tools.training import corpus, tokenizer

MESSAGES = [
    {"role": "user", "content": "Who's there?"},
    {"role": "assistant", "content": "Nay, answer me: stand, and unfold yourself."},
    {"role": "user", "content": "Long live the king!"},
]
TEXTS = [
    "Héllo, wörld — ça va? 日本語 🎭",
    "Ham.\nTo be, or not to be,\n\n  tabs\tand  spaces ",
    "",
]


def test_normalize_and_split(excerpt: Path) -> None:
    docs = corpus.load_documents(excerpt)
    assert len(docs) == 1 and "\n\n\n" not in docs[0].text and "\r" not in docs[0].text
    train, val = corpus.split_documents(docs, 0.1)
    assert train[0].text.rstrip("\n") + "\n\n" + val[0].text == docs[0].text
    assert 0.05 < len(val[0].text) / len(docs[0].text) < 0.15


def test_speeches_and_chat_exchanges(excerpt: Path) -> None:
    docs = corpus.load_documents(excerpt)
    speeches = corpus.speeches(docs[0].text)
    assert speeches[:2] == ["Who's there?", "Nay, answer me: stand, and unfold yourself."]
    assert not any(s.startswith(("[", "Ber.", "Fran.")) for s in speeches)
    convs = corpus.chat_exchanges(docs, count=5, seed=0)
    assert len(convs) == 5
    for conv in convs:
        assert [m["role"] for m in conv] in (["user", "assistant"], ["user", "assistant"] * 2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, excerpt: Path) -> Path:
    tok = tokenizer.train_tokenizer([excerpt.read_text()], 512)
    out = tmp_path_factory.mktemp("tok")
    tokenizer.save_tokenizer(tok, out, 256)
    return out


def test_tokenizer_roundtrip_and_specials(trained: Path) -> None:
    tok = AutoTokenizer.from_pretrained(trained)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 512
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template(trained: Path) -> None:
    tok = AutoTokenizer.from_pretrained(trained)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|>User.\nWho's there?\n\n"
        "Assistant.\nNay, answer me: stand, and unfold yourself.<|eos|>\n\n"
        "User.\nLong live the king!\n\nAssistant.\n"
    )
    assert text == tokenizer.render_chat(MESSAGES, add_generation_prompt=True)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.eos_token_id) == 1
