"""Random-init EAGLE heads for tests: the training module's init, saved as the worker loads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stoker.services.worker.eagle.config import EagleConfig, default_target_layers, head_config_dict
from stoker.tools.training.eagle import save_head
from stoker.tools.training.eagle_net import EagleNet
from tests.factory import make_model
from tests.spec.spec_models import SpecModels


def make_head(
    target: Path, out: Path, seed: int = 0, num_layers: int = 1, draft_vocab: int = 0
) -> Path:
    """draft_vocab > 0: a reduced draft vocabulary of that many random target ids."""
    raw = json.loads((target / "config.json").read_text())
    layers = default_target_layers(raw["num_hidden_layers"])
    config = head_config_dict(raw, layers, num_layers, draft_vocab)
    net = EagleNet(EagleConfig.from_dict(config), seed=seed)
    if net.d2t is not None:
        net.d2t.copy_(random_vocab(raw["vocab_size"], draft_vocab, seed))
    save_head(out, config, net)
    return out


def random_vocab(vocab_size: int, size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(vocab_size, generator=gen)[:size]).values


def train_head(target: Path, out: Path, steps: int = 200, draft_vocab: int = 256) -> Path:
    """`stoker train-draft --method eagle` for a few seconds on a tiny target (fixed seeds),
    by default drafting over half its 512 tokens (the reduced-vocabulary path)."""
    from stoker.tools.training.train_draft import main

    argv = ["--method", "eagle", "--target", str(target), "--out", str(out)]
    argv += ["--num-prompts", "40", "--gen-tokens", "40", "--steps", str(steps)]
    argv += ["--lr", "3e-3", "--device", "cpu", "--draft-vocab", str(draft_vocab)]
    assert main(argv) == 0
    return out


_heads: dict[tuple[str, str], Path] = {}


def head_factory(
    spec_models: Callable[[str], SpecModels], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """For a session fixture: (arch, "trained" | "random") -> a head for that arch's spec
    target, built once per session whichever test module asks first."""

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in _heads:
            target = spec_models(arch).target
            out = tmp_path_factory.mktemp(f"eagle-{arch}-{kind}")
            _heads[arch, kind] = (
                train_head(target, out) if kind == "trained" else make_head(target, out, seed=1)
            )
        return _heads[arch, kind]

    return get


def oracle_pair(
    root: Path, noise: float = 0.0, seed: int = 0, draft_vocab: int = 0
) -> tuple[Path, Path]:
    """A 1-layer Llama target whose embedding rows have unit RMS, and a head that is that
    target: in_proj passes the (then unchanged by its norm) embedding through and ignores the
    feature, its layer and final norm are the target's. So its drafts are the target's own
    tokens and its q the target's p (noise > 0: Gaussian noise of noise * each weight's std on
    the copied layer, for partial acceptance; draft_vocab > 0: it drafts only over that many
    random ids, so q is zero on the rest and their mass comes from the residual)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    target = root / "oracle-target"
    if not (target / "config.json").exists():
        make_model(target, "llama", num_layers=1)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        with torch.no_grad():
            emb = model.model.embed_tokens.weight
            emb /= emb.pow(2).mean(-1, keepdim=True).sqrt()
        model.save_pretrained(target)
    raw = json.loads((target / "config.json").read_text())
    config = head_config_dict(raw, (0,), 1, draft_vocab)
    weights = {}
    from safetensors import safe_open

    with safe_open(str(next(target.glob("*.safetensors"))), framework="pt") as f:
        weights = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 - not a dict
    layer = "model.layers.0."
    h = raw["hidden_size"]
    gen = torch.Generator().manual_seed(seed)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        return t + noise * float(t.std()) * torch.randn(t.shape, generator=gen)

    state = {
        "fuse": torch.zeros(h, h),
        "embed_norm": torch.ones(h),
        "feature_norm": torch.ones(h),
        "in_proj": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
        "layers.0.input_norm": weights[layer + "input_layernorm.weight"],
        "layers.0.post_attn_norm": weights[layer + "post_attention_layernorm.weight"],
        "layers.0.attn.qkv_proj": noisy(
            torch.cat([weights[layer + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        ),
        "layers.0.attn.o_proj": noisy(weights[layer + "self_attn.o_proj.weight"]),
        "layers.0.mlp.gate_up_proj": noisy(
            torch.cat([weights[layer + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
        ),
        "layers.0.mlp.down_proj": noisy(weights[layer + "mlp.down_proj.weight"]),
        "norm": weights["model.norm.weight"],
    }
    if draft_vocab:
        state["d2t"] = random_vocab(raw["vocab_size"], draft_vocab, seed)
    head = root / f"oracle-head-{noise}-{draft_vocab}"
    head.mkdir(parents=True, exist_ok=True)
    (head / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(head / "model.safetensors"))
    return target, head
