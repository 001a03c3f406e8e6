"""User turns written by the target (tools/training/self_chat.py) and `train-draft --self-chat`,
on the bundled stoker-tiny model (trained on Shakespeare; its chat template ends a user turn with
a blank line, which it writes often, so its turns end within a few dozen tokens)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from stoker.tools.training.self_chat import self_chat_turns, user_turn_bounds
from stoker.tools.training.train_draft import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "stoker-tiny"


def test_user_turn_bounds() -> None:
    tok = AutoTokenizer.from_pretrained(TINY)
    before, after = user_turn_bounds(tok)
    assert before == tok.bos_token + "User.\n" and after == "\n\n"
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Who's there?"}], tokenize=False
    )
    assert rendered == before + "Who's there?" + after
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: ...\n{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        user_turn_bounds(tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        user_turn_bounds(tok)


def test_turns_are_distinct_complete_and_reproducible() -> None:
    first = self_chat_turns(TINY, 6, seed=3)
    assert len(first) == 6 and len({" ".join(t.casefold().split()) for t in first}) == 6
    for turn in first:
        assert len(turn.split()) >= 3 and turn == turn.strip() and "\n\n" not in turn
    # Seeds are per sample, so leaving one turn out (as the benchmark's held-out prompts are)
    # keeps the others and draws one more.
    again = self_chat_turns(TINY, 6, seed=3, exclude=[first[0].upper()])
    assert again[:5] == first[1:] and again[5] not in first


def test_train_draft_self_chat(tmp_path: Path) -> None:
    out = tmp_path / "head"
    argv = ["--method", "eagle", "--target", str(TINY), "--out", str(out), "--self-chat"]
    argv += ["--num-prompts", "10", "--gen-tokens", "16", "--steps", "2", "--device", "cpu"]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["EagleHead"]
    assert "--self-chat" in (out / "README.md").read_text()


def test_self_chat_needs_a_chat_template(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "no-template"
    shutil.copytree(TINY, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["--method", "eagle", "--target", str(target), "--out", str(tmp_path / "o")]
    assert main([*argv, "--self-chat", "--num-prompts", "4"]) == 2
    assert "no chat template" in capsys.readouterr().err
