"""The grammar-mask kernel (kernels/token_mask.py): the native CPU kernel against the torch
reference and a bit-by-bit loop, over random masks with all-zero and all-one words, a subset
of rows, and a vocabulary that is not a multiple of 32 (or wider than the mask)."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import cpu_ops
from stoker.kernels.token_mask import apply_token_bitmask, apply_token_bitmask_reference


def _mask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    kind = torch.randint(0, 3, (rows, words), generator=g)
    bitmask[kind == 0] = 0
    bitmask[kind == 1] = -1
    return bitmask


def _loop(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    for r in rows:
        for v in range(logits.shape[1]):
            w = v // 32
            allowed = w < words and (int(bitmask[r, w]) >> (v % 32)) & 1
            if not allowed:
                out[r, v] = float("-inf")
    return out


@pytest.mark.parametrize(("vocab", "words"), [(100, 4), (64, 2), (70, 2), (1000, 32)])
def test_kernel_and_reference_match_a_loop(vocab, words):
    logits = torch.randn(6, vocab)
    bitmask = _mask(6, words, vocab)
    rows = [0, 2, 5]
    want = _loop(logits, bitmask, rows)
    ref = logits.clone()
    apply_token_bitmask_reference(ref, bitmask, torch.tensor(rows))
    assert torch.equal(ref, want)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, want)


def test_native_kernel_is_built_here():
    """The fast path exists where a compiler does (CI's machine), so the test above ran it."""
    if cpu_ops.load() is None:
        pytest.skip("native CPU kernels unavailable (STOKER_CPU_KERNELS=0 or no compiler)")
    logits = torch.randn(2, 64)
    none = torch.zeros(2, 2, dtype=torch.int32)
    assert cpu_ops.apply_token_bitmask(logits, none, torch.tensor([1]), float("-inf"))
    assert torch.isinf(logits[1]).all() and not torch.isinf(logits[0]).any()
    floor = logits.to(torch.bfloat16)
    assert cpu_ops.apply_token_bitmask(floor, none, torch.tensor([0]), -1e30)
    assert bool((floor[0].float() < -1e29).all())
