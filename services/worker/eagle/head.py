"""The EAGLE head's forward on the worker: paged KV, the target's kernels.

Row p of the head pairs the feature of position p - 1 with the embedding of token p and
predicts token p + 1, so its K/V sit at the target's positions. A feature is the fusion of the
target's tapped layer outputs (`fuse`), or, inside a chain of drafts, the head's own output at
the previous position (EAGLE's feature autoregression). Position 0 has no earlier feature: it
gets zeros, in training as here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from stoker.common.model_config import ModelLoadError
from stoker.kernels.dispatch import rms_norm
from stoker.kernels.rotary import rope_cos_sin, rope_inv_freq
from stoker.services.worker.attention_metadata import AttentionMetadata
from stoker.services.worker.eagle.config import WEIGHTS, EagleConfig
from stoker.services.worker.loader import packs_linear_weights
from stoker.services.worker.models.layers import KVCache, linear, pack_module_linears, param
from stoker.services.worker.models.llama import DecoderLayer, enable_native_layers


class EagleHead(nn.Module):
    LINEAR_WEIGHTS = ("fuse", "in_proj")  # the decoder layers name their own
    d2t: torch.Tensor | None

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.eps = cfg.layer_cfg.rms_norm_eps
        self.fuse = param(h, len(cfg.target_layers) * h)
        self.embed_norm = param(h)
        self.feature_norm = param(h)
        self.in_proj = param(h, 2 * h)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer_cfg, i) for i in range(cfg.num_layers))
        self.norm = param(h)
        if cfg.draft_vocab_size:  # draft index -> target token id
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_rope(self, max_positions: int, device: torch.device | str) -> None:
        c = self.cfg.layer_cfg
        cos, sin = rope_cos_sin(
            rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling), max_positions
        )
        self.rope = (cos.to(device), sin.to(device))

    def fuse_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """[T, layers * hidden] target layer outputs -> [T, hidden] features."""
        return linear(taps, self.fuse)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """-> the head's output stream [T, hidden] (pre-norm: the next draft's feature)."""
        assert self.rope is not None
        x = torch.cat(
            [
                rms_norm(embeds, self.embed_norm, self.eps),
                rms_norm(features, self.feature_norm, self.eps),
            ],
            dim=-1,
        )
        hidden = linear(x, self.in_proj)
        cos, sin = self.rope
        rope = (cos[positions].to(hidden.dtype), sin[positions].to(hidden.dtype))
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta)
        assert residual is not None
        return hidden + residual

    def final_norm(self, stream: torch.Tensor) -> torch.Tensor:
        return rms_norm(stream, self.norm, self.eps)


def load_head(
    folder: str | Path,
    cfg: EagleConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> EagleHead:
    with torch.device("meta"):
        head = EagleHead(cfg)
    state = load_file(str(Path(folder) / WEIGHTS))
    expected = set(head.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ModelLoadError(f"EAGLE head {folder}: missing {missing[:5]}, unexpected {extra[:5]}")
    if "d2t" in state:
        d2t = state["d2t"]
        vocab = cfg.layer_cfg.vocab_size
        if d2t.dtype != torch.long or len(d2t) != cfg.draft_vocab_size:
            raise ModelLoadError(f"EAGLE head {folder}: d2t must be {cfg.draft_vocab_size} ids")
        if len(d2t.unique()) != len(d2t) or int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
            raise ModelLoadError(f"EAGLE head {folder}: d2t must be distinct ids below {vocab}")
    head.load_state_dict(
        {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in state.items()},
        assign=True,
    )
    head.init_rope(max_positions, device)
    # As the target's: F.linear cost 6.8 of a 15 ms chain of 4.
    if packs_linear_weights(device, dtype):
        pack_module_linears(head)
    enable_native_layers(head, torch.device(device), dtype)
    return head.eval()
