"""Exact greedy tokens from a cheaper LM head (CPU, float32 models).

The float32 LM head is a fifth of a SmolLM2 decode step's FLOPs, and a step whose rows only need
their argmax (greedy, no penalties, logit bias or logprobs) reads nothing else from the logits.
On a CPU with AVX512-BF16, oneDNN computes the head in bfloat16 in half the time. Its logits
are not the float32 ones, but each lies within a bound of it, so this keeps the tokens whose
bounded logit could still be the row's maximum (usually one to a few,
kernels/csrc/greedy_screen.cpp) and recomputes only those with the float32 panel kernel. That
kernel computes every output as one FMA chain over the hidden size in order, whichever columns
it is given, so the recomputed logits are bit for bit the full head's, and the argmax (the first
index among equal maxima) is the one the full head gives. Output is unchanged; only the cost of
getting it is.

The bound, for a hidden row h and a vocabulary row w, with bfloat16 rounding u = 2^-9 and float32
rounding e = 2^-24 over K products:
    |bf16 logit - float32 logit| <= (2u + u^2 + 2.1 K e) * sum_i |h_i w_i| + 2u |bf16 logit|
where the first term is rounding both inputs to bfloat16 plus both sums' float32 accumulation,
the second the bfloat16 output's rounding, and sum_i |h_i w_i| <= ||h|| ||w|| (Cauchy-Schwarz).
Rows holding a non-finite logit, or too many candidates, are computed in full.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from stoker.kernels import cpu_ops
from stoker.kernels.token_mask import allowed_at, apply_token_bitmask
from stoker.services.worker.models.layers import linear, pack_weight

log = logging.getLogger("stoker.worker")

# Candidates per row past which the row's full float32 logits are cheaper to compute.
MAX_CANDIDATES = 64
OUTPUT_REL = 2.0**-8  # the bfloat16 output's rounding, 2u
SLACK = 1e-30  # flushed subnormal products (oneDNN's bfloat16 kernels flush them)
MASKED = -1e30  # a grammar-disallowed token's bfloat16 logit


def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes bfloat16 dot products in hardware (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def wanted(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """STOKER_GREEDY_HEAD=on / off forces the choice; by default on for a float32 model on a CPU
    with native bfloat16, whose LM head is panel-packed (the recompute must be the same kernel)
    and whose logits are not soft-capped (the cap's rounding could make ties the head has not)."""
    choice = os.environ.get("STOKER_GREEDY_HEAD", "auto")
    if choice == "off" or device.type != "cpu" or dtype != torch.float32:
        return False
    packed = getattr(model, "packed_lm_head", None)
    if packed is None or packed.dim() != 3 or getattr(model, "comm", None) is not None:
        return False  # not panel-packed, or a tensor-parallel shard of the head
    if model.cfg.final_softcap is not None or cpu_ops.load() is None:
        return False
    return choice == "on" or cpu_has_native_bf16()


class GreedyHead:
    """The argmax of `linear(hidden, packed)` for rows that need nothing else."""

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: the float32 LM head, [vocab, hidden], as packed into the model's panels."""
        self.weight = weight
        hidden = weight.shape[1]
        # float64 norms, rounded up: the bound must hold for the computed numbers too.
        self.col_norm = (weight.double().norm(dim=1) * (1 + 1e-6)).float()
        self.scale = (2 * 2.0**-9 + 2.0**-18 + 2.1 * hidden * 2.0**-24) * (1 + 1e-4)
        bf16 = weight.detach().to(torch.bfloat16).contiguous()
        # Laid out as a bfloat16 model's linears are (`pack_weight`: the native pair kernel's
        # layout, else the panel kernel's, else oneDNN's, else plain).
        self._packed = pack_weight(bf16)
        self.rows_screened = 0  # rows answered by the screen, and rows computed in full
        self.rows_full = 0

    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """bfloat16 logits: the native pair kernel's (kernels/csrc/bf16_pairs.cpp: exact products,
        float32 sums, rounded to bfloat16 once; 1.1-1.9x faster than oneDNN's at 1-64 rows of
        SmolLM2's head), else oneDNN's, which round the same way."""
        return linear(hidden.to(torch.bfloat16), self._packed)

    def argmax(
        self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """[R] int64 greedy tokens of float32 hidden rows [R, hidden]; None: some row needs the
        full head (the caller then computes the logits as usual). bitmask: a grammar's allowed
        tokens per row (worker/grammar.py), so the tokens are the masked logits' argmax."""
        module = cpu_ops.load()
        assert module is not None
        row_scale = (hidden.double().norm(dim=1) * self.scale).float()
        approx = self.approx_logits(hidden)
        if bitmask is not None:
            # A finite floor, far below any bound: never a candidate, and the screen (which
            # sends non-finite rows to the full head) still answers the row.
            every_row = torch.arange(len(hidden), dtype=torch.int64)
            apply_token_bitmask(approx, bitmask, every_row, MASKED)
        candidates, counts = module.greedy_candidates(
            approx, row_scale, self.col_norm, OUTPUT_REL, SLACK, MAX_CANDIDATES
        )
        if bool((counts < 0).any()):
            self.rows_full += len(hidden)
            return None
        # One recompute over every row's candidates: each row's maximum is among its own, so
        # the maximum over the union is the same token (and the first of any tie).
        union = torch.unique(candidates[candidates >= 0])  # sorted
        n = len(union)
        rows = self.weight[union]
        pad = -n % 16
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        exact = cpu_ops.panel_linear(hidden, cpu_ops.pack_panels(rows))[:, :n]
        if bitmask is not None:  # another row's candidate may be one this row disallows
            exact.masked_fill_(~allowed_at(bitmask, union), float("-inf"))
        self.rows_screened += len(hidden)
        return union[exact.argmax(dim=-1)]
