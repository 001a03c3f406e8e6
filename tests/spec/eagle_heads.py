"""Random-init EAGLE heads for tests: the training module's init, saved as the worker loads it."""

from __future__ import annotations

import json
from pathlib import Path

from services.training.eagle import save_head
from services.training.eagle_net import EagleNet
from services.worker.eagle.config import EagleConfig, default_target_layers, head_config_dict


def make_head(target: Path, out: Path, seed: int = 0, num_layers: int = 1) -> Path:
    raw = json.loads((target / "config.json").read_text())
    config = head_config_dict(raw, default_target_layers(raw["num_hidden_layers"]), num_layers)
    save_head(out, config, EagleNet(EagleConfig.from_dict(config), seed=seed))
    return out


def train_head(target: Path, out: Path, steps: int = 60) -> Path:
    """`stoker train-draft --method eagle` for a few seconds on a tiny target (fixed seeds)."""
    from services.training.train_draft import main

    argv = ["--method", "eagle", "--target", str(target), "--out", str(out)]
    argv += ["--num-prompts", "40", "--gen-tokens", "40", "--steps", str(steps)]
    argv += ["--lr", "3e-3", "--device", "cpu"]
    assert main(argv) == 0
    return out
