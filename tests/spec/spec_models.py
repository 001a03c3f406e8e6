"""Random-init target and draft models for the speculative decoding tests (tests/factory.py:
tiny HF folders sharing one deterministic tokenizer)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.factory import make_model

ARCHS: dict[str, dict[str, int]] = {
    "llama": {},
    "qwen3": {"head_dim": 32},  # head_dim != hidden / heads
}


@dataclasses.dataclass(frozen=True)
class SpecModels:
    target: Path
    draft_1layer: Path  # another seed, 1 layer: a valid but bad draft (almost nothing accepted)
    draft_noisy: Path  # the target with 10% weight noise: partial acceptance (about a third)

    def draft(self, name: str) -> Path:
        return {"1layer": self.draft_1layer, "noisy": self.draft_noisy, "self": self.target}[name]


def noisy_copy(src: Path, dst: Path, eps: float, seed: int = 0) -> Path:
    """The model at `src` with Gaussian noise of eps * (each tensor's std) on every weight."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            scale = eps * float(param.std().clamp_min(1e-3)) if param.numel() > 1 else 0.0
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def build(root: Path, arch: str) -> SpecModels:
    extra = ARCHS[arch]
    target = make_model(root / "target", arch, **extra)
    return SpecModels(
        target=target,
        draft_1layer=make_model(root / "d1", arch, num_layers=1, seed=7, **extra),
        draft_noisy=noisy_copy(target, root / "noisy", eps=0.1),
    )
