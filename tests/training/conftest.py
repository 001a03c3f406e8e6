"""Fixtures for the training tests: the committed corpus excerpt and a random tiny target."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
EXCERPT = REPO / "tests" / "data" / "hamlet_excerpt.txt"


@pytest.fixture(scope="session")
def excerpt() -> Path:
    return EXCERPT


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Llama with a BPE tokenizer trained on the excerpt."""
    from stoker.tools.training import net, tokenizer
    from stoker.tools.training.corpus import load_documents
    from stoker.tools.training.model import LlamaSize, llama_config, save_model

    out = tmp_path_factory.mktemp("tiny-target")
    tok = tokenizer.train_tokenizer([d.text for d in load_documents(EXCERPT)], 384)
    tokenizer.save_tokenizer(tok, out, 128)
    ids = tokenizer.special_ids(tok)
    size = LlamaSize(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=2)
    config = llama_config(size, tok.get_vocab_size(), 128, ids["bos"], ids["eos"], ids["pad"])
    model = net.LeanLlama(config)
    model.init_weights(seed=0)
    import torch

    save_model(config, net.to_hf_state_dict(model), out, torch.float32)
    return out
