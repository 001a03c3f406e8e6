"""Triton attention with a sliding window and score soft-capping, against the torch references,
on CPU tensors under the triton interpreter or compiled on CUDA (tests/kernels/triton_device.py;
see test_triton_kernels.py for the set-up)."""

from __future__ import annotations

# First: it picks the device, and sets TRITON_INTERPRET=1 on CPU before any kernel import.
from tests.kernels.triton_device import DEVICE, ON_CUDA, tensor

# isort: split
import importlib  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from stoker.kernels import paged_attention as ref_attn  # noqa: E402
from stoker.kernels import triton_attention as ta  # noqa: E402

if not ON_CUDA and type(ta._decode_kernel).__name__ != "InterpretedFunction":  # compiled earlier
    ta = importlib.reload(ta)

TOL = dict(rtol=1e-4, atol=1e-4)
HK = 2
SETTINGS = [(8, None), (None, 5.0), (21, 2.0)]


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    def nan_empty(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(ta, "_empty", nan_empty)


def _paged(gen, lens, block_size, head_dim):
    width = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * width + 3
    shape = (num_blocks, block_size, HK, head_dim)
    kc, vc = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    return kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE)


def _randn(gen, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE)


@pytest.mark.parametrize("window, softcap", SETTINGS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(window, softcap, num_splits):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 7, 16, 17, 40, 90]
    kc, vc, tables = _paged(gen, lens, 16, 64)
    q = _randn(gen, len(lens), HK * 4, 64) * 2
    args = (q, kc, vc, tables, tensor(lens), 0.125, window, softcap)
    got = ta.paged_decode_attention(*args, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got, ref_attn.paged_decode_attention(*args), **TOL)


@pytest.mark.parametrize("window, softcap", SETTINGS)
@pytest.mark.parametrize("prefix, chunk", [(0, 37), (21, 9), (70, 5)])
def test_prefill(window, softcap, prefix, chunk):
    gen = torch.Generator().manual_seed(prefix + chunk)
    context = prefix + chunk
    kc, vc, tables = _paged(gen, [context], 16, 64)
    q = _randn(gen, chunk, HK * 2, 64) * 2
    args = (q, kc, vc, tables[0], context, 0.125, window, softcap)
    want = ref_attn.paged_prefill_attention(*args)
    torch.testing.assert_close(ta.paged_prefill_attention(*args), want, **TOL)
    torch.testing.assert_close(
        ta.paged_prefill_attention(*args, block_m=16, block_n=16), want, **TOL
    )


@pytest.mark.parametrize("window, softcap", SETTINGS)
def test_varlen_and_causal(window, softcap):
    gen = torch.Generator().manual_seed(7)
    q_and_ctx = [(1, 35), (11, 11), (9, 49), (5, 103)]
    q_lens, lens = [n for n, _ in q_and_ctx], [c for _, c in q_and_ctx]
    kc, vc, tables = _paged(gen, lens, 16, 64)
    cu = tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = _randn(gen, sum(q_lens), HK * 4, 64) * 2
    got = ta.paged_attention_varlen(
        q, kc, vc, tables, cu, tensor(lens), max(q_lens), 0.125, window, softcap
    )
    for r in range(len(lens)):
        rows = slice(int(cu[r]), int(cu[r + 1]))
        want = ref_attn.paged_prefill_attention(
            q[rows], kc, vc, tables[r], lens[r], 0.125, window, softcap
        )
        torch.testing.assert_close(got[rows], want, **TOL)
    k, v = _randn(gen, 37, HK, 64), _randn(gen, 37, HK, 64)
    qc = _randn(gen, 37, HK * 4, 64) * 2
    torch.testing.assert_close(
        ta.causal_attention(qc, k, v, 0.125, window, softcap, block_m=16, block_n=16),
        ref_attn.causal_attention(qc, k, v, 0.125, window, softcap),
        **TOL,
    )


WINDOW_COMPILE = """
for dtype in (torch.float32, torch.bfloat16):
    for group, d, bs in ((1, 64, 16), (4, 128, 32)):
        kc = torch.empty(8, bs, 2, d, dtype=dtype)
        tables = torch.zeros(2, 4, dtype=torch.int64)
        lens = torch.ones(2, dtype=torch.int64)
        q = torch.empty(2, 2 * group, d, dtype=dtype)
        cu = torch.zeros(3, dtype=torch.int32)
        for window, softcap in ((8, None), (None, 5.0), (8, 5.0)):
            for splits in (1, 4):
                ta.paged_decode_attention(
                    q, kc, kc, tables, lens, 0.1, window, softcap, num_splits=splits
                )
            ta.paged_prefill_attention(q, kc, kc, tables[0], 9, 0.1, window, softcap)
            ta.paged_attention_varlen(q, kc, kc, tables, cu, lens, 2, 0.1, window, softcap)
            ta.causal_attention(q, q[:, :2], q[:, :2], 0.1, window, softcap)
print("ok", len(built))
"""


@pytest.mark.slow
def test_window_and_softcap_kernels_compile_for_sm90():
    """The window / soft-cap branches compiled to sm_90 with triton's bundled ptxas (no GPU):
    what the interpreter accepts but the compiler might reject."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.kernels.test_triton_kernels import COMPILE_SCRIPT

    script = COMPILE_SCRIPT[: COMPILE_SCRIPT.index("for dtype in")] + WINDOW_COMPILE
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-4000:]
