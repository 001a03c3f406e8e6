"""The gated MLP's activation: act(gate) * up over a fused [T, 2 * inter] gate_up row. Torch
reference, numerically HF's (the activation rounds to the input dtype, then the product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
