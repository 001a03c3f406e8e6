"""scripts/train_default_model.py --smoke: the whole recipe, tiny, offline, into a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]


def test_smoke_mode_end_to_end(excerpt: Path, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "train_default_model.py"), "--smoke"]
    cmd += ["--corpus", str(excerpt), "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val perplexity" in proc.stdout and "top-1 agreement" in proc.stdout
    for name in ("stoker-tiny", "stoker-tiny-draft"):
        folder = tmp_path / name
        model = AutoModelForCausalLM.from_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        ids = tok("Ham.\n", return_tensors="pt")
        assert model.generate(**ids, max_new_tokens=4, do_sample=False).shape[1] > 2
        assert "README.md" in os.listdir(folder)
    report = json.loads((tmp_path / "stoker-tiny" / "train_report.json").read_text())
    assert report["steps"] > 0 and report["val_perplexity"] > 1.0
    assert not (tmp_path / "stoker-tiny-draft" / "checkpoint").exists()
