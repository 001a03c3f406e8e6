"""`--speculative draft` without `--speculative-model` picks the model's own bundled draft: the
SmolLM2 EAGLE head for SmolLM2 (matched by its cache folder, wherever the cache lives), the toy
model's draft for anything else."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stoker.common import model_registry
from stoker.common.config import DEFAULT_DRAFT_MODEL, EngineConfig
from stoker.common.config_args import add_flags, from_args
from stoker.common.model_registry import BUNDLED_DIR, FETCHED, default_draft

HEAD = BUNDLED_DIR / "smollm2-eagle"


def test_other_models_get_the_toy_draft(tmp_path: Path) -> None:
    assert default_draft(BUNDLED_DIR / "stoker-tiny") == DEFAULT_DRAFT_MODEL
    assert default_draft(tmp_path / "some-model") == DEFAULT_DRAFT_MODEL
    config = EngineConfig(model=str(BUNDLED_DIR / "stoker-tiny"), speculative="draft")
    assert config.speculative_model == str(DEFAULT_DRAFT_MODEL)


@pytest.mark.skipif(not (HEAD / "config.json").is_file(), reason="the head is not built")
def test_smollm2_gets_its_eagle_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_MODEL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / FETCHED["smollm2"].folder
    folder.mkdir(parents=True)
    assert default_draft(folder) == HEAD
    assert default_draft(tmp_path / "cache" / "other") == DEFAULT_DRAFT_MODEL
    # A head missing from the checkout falls back rather than naming a folder that is not there.
    monkeypatch.setattr(model_registry, "BUNDLED_DIR", tmp_path / "empty")
    assert default_draft(folder) == tmp_path / "empty" / "stoker-tiny-draft"


def test_default_k_follows_the_method() -> None:
    """n-gram drafts cost nothing to propose, so it offers 8 per verify; a draft model or head
    pays a forward per draft and offers 4. An explicit k wins, and the CLI passes None through."""
    tiny = str(BUNDLED_DIR / "stoker-tiny")
    assert EngineConfig(model=tiny, speculative="ngram").num_speculative_tokens == 8
    assert EngineConfig(model=tiny, speculative="draft").num_speculative_tokens == 4
    explicit = EngineConfig(model=tiny, speculative="ngram", num_speculative_tokens=3)
    assert explicit.num_speculative_tokens == 3
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    args = parser.parse_args(["--model", tiny, "--speculative", "ngram"])
    assert from_args(EngineConfig, args).num_speculative_tokens == 8
