"""`stoker train-draft` (tools.training.train_draft.main) on a random tiny target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stoker.tools.training import tokenizer
from stoker.tools.training.train_draft import main

SMALL = ["--num-prompts", "8", "--prompt-tokens", "8", "--gen-tokens", "12"]
SMALL += ["--batch-size", "4", "--layers", "1", "--hidden", "64"]
FAST = [*SMALL, "--steps", "4"]


def test_train_draft_end_to_end(tiny_target: Path, excerpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "draft"
    args = ["--target", str(tiny_target), "--out", str(out), "--corpus", str(excerpt)]
    assert main([*args, *FAST, "--seed", "1"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 64
    assert (
        model.config.vocab_size
        == AutoModelForCausalLM.from_pretrained(tiny_target).config.vocab_size
    )
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(tiny_target).get_vocab()
    ids = tok("Ham.\nTo be", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 5
    card = (out / "README.md").read_text()
    assert "Teacher-forced top-1 agreement" in card and "k=4" in card
    report = json.loads((out / "distill_report.json").read_text())
    assert 0.0 <= report["agreement_text"] <= 1.0 and 0.0 <= report["accept_k4"] <= 4.0
    assert f"{100 * report['agreement_text']:.1f}%" in card
    assert not (out / "checkpoint").exists()


def test_resume_from_checkpoint(
    tiny_target: Path, excerpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "draft"
    args = ["--target", str(tiny_target), "--out", str(out), "--corpus", str(excerpt), *SMALL]
    assert main([*args, "--steps", "4", "--keep-checkpoint"]) == 0
    first = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert first["loop"]["step"] == 4
    capsys.readouterr()
    assert main([*args, "--steps", "6"]) == 0
    printed = capsys.readouterr().out
    assert "resuming from" in printed and "at step 4" in printed
    assert "cached generations" in printed
    assert json.loads((out / "distill_report.json").read_text())["steps"] == 6


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) != 0
    return capsys.readouterr().err


def test_input_validation(
    tiny_target: Path, excerpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path / "out")]
    assert "not a folder" in _error(["--target", str(tmp_path / "nope"), *out], capsys)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_target, broken)
    (broken / "config.json").unlink()
    assert "no config.json" in _error(["--target", str(broken), *out], capsys)
    shutil.copy(tiny_target / "config.json", broken / "config.json")
    (broken / "tokenizer.json").unlink()
    assert "no tokenizer" in _error(["--target", str(broken), *out], capsys)
    target = ["--target", str(tiny_target)]
    err = _error([*target, *out, "--corpus", str(tmp_path / "missing.txt")], capsys)
    assert "--corpus" in err
    err = _error([*target, *out, "--prompt-tokens", "100", "--gen-tokens", "100"], capsys)
    assert "max_position_embeddings" in err
    assert not (tmp_path / "out").exists()


def test_incompatible_tokenizer_in_out(
    tiny_target: Path, excerpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    other = tokenizer.train_tokenizer(["a completely different corpus " * 50], 300)
    tokenizer.save_tokenizer(other, out, 128)
    err = _error(["--target", str(tiny_target), "--out", str(out), *FAST], capsys)
    assert "different tokenizer" in err


def test_acceptance_counts_leading_agreements() -> None:
    from stoker.tools.training.distill import acceptance, generated_region

    m = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    # windows of 4 starting at t=0..4: 2, 1, 0, 4, 3 accepted
    accepted, probs = acceptance(m, 4)
    assert accepted == pytest.approx((2 + 1 + 0 + 4 + 3) / 5)
    assert probs == pytest.approx([4 / 5, 3 / 5, 2 / 5, 1 / 5])
    all_true = torch.ones(3, 10, dtype=torch.bool)
    assert acceptance(all_true, 4)[0] == pytest.approx(4.0)
    matches = torch.arange(12).view(2, 6)
    starts, mask = torch.tensor([2, 3]), torch.tensor([[1] * 5 + [0], [1] * 6]).float()
    assert generated_region(matches, starts, mask).tolist() == [[1, 2, 3], [8, 9, 10]]


def test_prompts_file(tiny_target: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Ham.\\nTo be, or not to be\nWho's there?\nLong live the king!\n\nMar.\n")
    out = tmp_path / "draft"
    assert (
        main(["--target", str(tiny_target), "--out", str(out), "--prompts", str(prompts), *FAST])
        == 0
    )
    report = json.loads((out / "distill_report.json").read_text())
    assert report["agreement_text"] is None and report["agreement_gen_tokens"] > 0
    assert "n/a" in (out / "README.md").read_text()
