"""Sliding-window attention and score soft-capping: the torch references against a naive
per-token loop, and the native CPU decode and prefill kernels against the references."""

from __future__ import annotations

import itertools

import pytest
import torch

from stoker.kernels import cpu_ops
from stoker.kernels.paged_attention import (
    causal_attention,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)
from tests.kernels.paged_cache import random_paged_cache

# (window, softcap): window only, softcap only, both; a window wider than every context.
SETTINGS = [(8, None), (None, 5.0), (13, 2.0), (1000, None)]
native = pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels not built here")


def _naive(q, kc, vc, table, positions, scale, window, softcap):
    """Query rows at `positions` see keys in (pos - window, pos], read slot by slot."""
    block_size, hk = kc.shape[1], kc.shape[2]
    group = q.shape[1] // hk
    out = torch.empty_like(q)
    for i, pos in enumerate(positions):
        first = 0 if window is None else max(0, pos - window + 1)
        slots = [(table[t // block_size], t % block_size) for t in range(first, pos + 1)]
        keys = torch.stack([kc[b, o] for b, o in slots])
        vals = torch.stack([vc[b, o] for b, o in slots])
        for h in range(q.shape[1]):
            s = (keys[:, h // group] @ q[i, h]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, dim=0) @ vals[:, h // group]
    return out


@pytest.mark.parametrize("window, softcap", SETTINGS)
def test_decode_reference_matches_naive(window, softcap):
    lens = [1, 7, 8, 9, 30, 53]
    kc, vc, tables = random_paged_cache(len(lens), 2, 32, 8, lens)
    q = torch.randn(len(lens), 8, 32) * 2
    got = paged_decode_attention(q, kc, vc, tables, torch.tensor(lens), 0.2, window, softcap)
    for i, n in enumerate(lens):
        want = _naive(q[i : i + 1], kc, vc, tables[i], [n - 1], 0.2, window, softcap)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap", SETTINGS)
@pytest.mark.parametrize("prefix, chunk", [(0, 20), (16, 9), (21, 3), (40, 17)])
def test_prefill_reference_matches_naive(window, softcap, prefix, chunk):
    context = prefix + chunk
    kc, vc, tables = random_paged_cache(1, 2, 32, 16, [context], seed=1)
    q = torch.randn(chunk, 8, 32) * 2
    got = paged_prefill_attention(q, kc, vc, tables[0], context, 0.3, window, softcap)
    positions = list(range(prefix, context))
    want = _naive(q, kc, vc, tables[0], positions, 0.3, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap", SETTINGS)
def test_causal_attention_equals_paged_prefill_from_zero(window, softcap):
    kc, vc, tables = random_paged_cache(1, 2, 16, 8, [20], seed=2)
    slots = torch.tensor([tables[0, t // 8] * 8 + t % 8 for t in range(20)])
    k, v, q = torch.randn(20, 2, 16), torch.randn(20, 2, 16), torch.randn(20, 4, 16)
    store_kv(kc, vc, k, v, slots)
    torch.testing.assert_close(
        causal_attention(q, k, v, 0.25, window, softcap),
        paged_prefill_attention(q, kc, vc, tables[0], 20, 0.25, window, softcap),
        rtol=1e-5,
        atol=1e-5,
    )


def test_window_changes_the_result():
    """The window is not a no-op: keys outside it carried weight."""
    lens = [40]
    kc, vc, tables = random_paged_cache(1, 2, 16, 8, lens, seed=4)
    q = torch.randn(1, 4, 16)
    full = paged_decode_attention(q, kc, vc, tables, torch.tensor(lens), 0.25)
    windowed = paged_decode_attention(q, kc, vc, tables, torch.tensor(lens), 0.25, 8)
    assert (full - windowed).abs().max() > 1e-3


@native
@pytest.mark.parametrize("window, softcap", SETTINGS + [(16, None), (17, None), (1, None)])
@pytest.mark.parametrize("hq, hk, d, block_size", [(8, 2, 64, 16), (4, 4, 32, 8), (6, 2, 256, 16)])
def test_native_decode_matches_reference(window, softcap, hq, hk, d, block_size):
    # Windows around the kernel's 16-token chunks and the block boundaries.
    lens = [1, 5, 15, 16, 17, 33, 100, 257]
    kc, vc, tables = random_paged_cache(len(lens), hk, d, block_size, lens, seed=3)
    q = torch.randn(len(lens), hq, d) * 3
    args = (q, kc, vc, tables, torch.tensor(lens), d**-0.5, window, softcap)
    got = cpu_ops.paged_decode_attention(*args)
    assert got is not None
    torch.testing.assert_close(got, paged_decode_attention(*args), rtol=1e-5, atol=1e-5)


@native
@pytest.mark.parametrize("window, softcap", SETTINGS + [(16, None), (1, None)])
@pytest.mark.parametrize("hq, hk, d", [(9, 3, 64), (4, 4, 32), (6, 2, 128)])
def test_native_prefill_matches_reference(window, softcap, hq, hk, d):
    # One call over chunks with and without a cached prefix; windows shorter and longer than a
    # work item's rows, so an item's first rows see keys its last rows no longer do.
    spans = [(0, 70), (40, 30), (200, 7), (0, 1)]  # (cached prefix, chunk length)
    lens = [p + n for p, n in spans]
    kc, vc, tables = random_paged_cache(len(spans), hk, d, 16, lens, seed=4)
    q = torch.randn(sum(n for _, n in spans), hq, d) * 3
    bounds = torch.tensor([0] + list(itertools.accumulate(n for _, n in spans)))
    got = cpu_ops.prefill_attention(
        q, kc, vc, tables, bounds, torch.tensor(lens), d**-0.5, window, softcap
    )
    assert got is not None
    for s, context_len in enumerate(lens):
        rows = slice(int(bounds[s]), int(bounds[s + 1]))
        want = paged_prefill_attention(
            q[rows], kc, vc, tables[s], context_len, d**-0.5, window, softcap
        )
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)
