"""Triton kernels against their torch references: on CPU tensors under the triton interpreter,
or compiled on the GPU where CUDA is present (tests/kernels/triton_device.py).

Every case draws its own random inputs (seeded from the case's parameters), and every output or
scratch buffer the kernels allocate is filled with NaN first, so an element a kernel forgets to
write fails the comparison. The default run keeps shapes small (the interpreter is slow); the
larger sweeps are marked slow. A slow test also compiles every kernel for sm_90 (no GPU needed:
triton's bundled ptxas), which catches what the interpreter lets through.
"""

from __future__ import annotations

# First: it picks the device, and sets TRITON_INTERPRET=1 on CPU before any kernel import.
from tests.kernels.triton_device import DEVICE, ON_CUDA, cpu_only, reference_backend, tensor

# isort: split
import importlib  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from stoker.kernels import activation as ref_act  # noqa: E402
from stoker.kernels import dispatch  # noqa: E402
from stoker.kernels import paged_attention as ref_attn  # noqa: E402
from stoker.kernels import rms_norm as ref_norm  # noqa: E402
from stoker.kernels import rotary as ref_rope  # noqa: E402
from stoker.kernels import triton_activation as tact  # noqa: E402
from stoker.kernels import triton_attention as ta  # noqa: E402
from stoker.kernels import triton_norm_rope as tn  # noqa: E402
from stoker.kernels import triton_sampling as ts  # noqa: E402

if not ON_CUDA and type(ta._decode_kernel).__name__ != "InterpretedFunction":  # compiled earlier
    ta, tn, ts = importlib.reload(ta), importlib.reload(tn), importlib.reload(ts)
    tact = importlib.reload(tact)

ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-4, atol=1e-4)
TOL_16 = dict(rtol=2e-2, atol=2e-2)
NUM_KV_HEADS = 2
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Kernel outputs and split-K scratch start as NaN: unwritten elements cannot pass."""

    def nan_empty(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(ta, "_empty", nan_empty)
    monkeypatch.setattr(tn, "_empty", nan_empty)
    monkeypatch.setattr(tact, "_empty", nan_empty)


def _gen(*case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _randn(gen, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _paged(gen, lens, block_size, head_dim, dtype=torch.float32, spare_columns=1):
    """K/V caches with every block random, and block tables of scattered, shuffled blocks, padded
    past each sequence (and by `spare_columns` more) with valid ids that must not be read."""
    width = max(-(-n // block_size) for n in lens) + spare_columns
    num_blocks = len(lens) * width + 3
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    kc, vc = _randn(gen, *shape, dtype=dtype), _randn(gen, *shape, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    return kc, vc, tables.to(DEVICE)


def _on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in tensors)


def _with_slow(default, full):
    return list(default) + [
        pytest.param(*c, marks=pytest.mark.slow) for c in full if c not in default
    ]


GROUPS, HEAD_DIMS, BLOCK_SIZES = (1, 4, 8), (64, 128), (16, 32)
SHAPES = _with_slow(
    [(1, 64, 16), (4, 128, 32), (8, 64, 32), (8, 128, 16)],
    itertools.product(GROUPS, HEAD_DIMS, BLOCK_SIZES),
)


# -- store_kv ------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(head_dim, block_size, dtype):
    gen = _gen("store", head_dim, block_size, dtype)
    num_blocks, num_tokens = 6, 23
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    kc, vc = (
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
    )
    # K and V as strided views of one fused projection, as the model produces them.
    qkv = _randn(gen, num_tokens, 3 * NUM_KV_HEADS * head_dim, dtype=dtype)
    _, k, v = qkv.view(num_tokens, 3, NUM_KV_HEADS, head_dim).unbind(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    ref_attn.store_kv(want_k, want_v, k, v, slots)
    ta.store_kv(kc, vc, k, v, slots)
    torch.testing.assert_close(kc, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc, want_v, rtol=0, atol=0, equal_nan=True)
    assert not kc.view(-1, NUM_KV_HEADS, head_dim)[slots].isnan().any()


def test_store_kv_skips_padding_slots():
    gen = _gen("store-pad")
    kc, vc = (torch.zeros(3, 16, NUM_KV_HEADS, 64, device=DEVICE) for _ in range(2))
    k, v = _randn(gen, 4, NUM_KV_HEADS, 64), _randn(gen, 4, NUM_KV_HEADS, 64)
    ta.store_kv(kc, vc, k, v, tensor([5, -1, 40, -1]))
    flat_k, flat_v = kc.view(-1, NUM_KV_HEADS, 64), vc.view(-1, NUM_KV_HEADS, 64)
    torch.testing.assert_close(flat_k[[5, 40]], k[[0, 2]], rtol=0, atol=0)
    torch.testing.assert_close(flat_v[[5, 40]], v[[0, 2]], rtol=0, atol=0)
    # Summed on CPU: a GPU reduction's order (hence rounding) differs between the two shapes.
    assert flat_k.cpu().abs().sum() == k[[0, 2]].cpu().abs().sum()


# -- decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("group, head_dim, block_size", SHAPES)
def test_decode_matches_reference(group, head_dim, block_size):
    gen = _gen("decode", group, head_dim, block_size)
    lens = [1, block_size - 1, block_size + 3, 3 * block_size + 5]
    kc, vc, tables = _paged(gen, lens, block_size, head_dim)
    q = _randn(gen, len(lens), NUM_KV_HEADS * group, head_dim)
    args = (q, kc, vc, tables, tensor(lens), head_dim**-0.5)
    torch.testing.assert_close(
        ta.paged_decode_attention(*args), ref_attn.paged_decode_attention(*args), **TOL
    )


@pytest.mark.parametrize("num_splits, block_n", [(3, 16), (4, 32), (8, 16)])
def test_decode_split_k_matches_reference(num_splits, block_n):
    """Split-K with splits past a short sequence's end (empty partials) and uneven lengths."""
    gen = _gen("split", num_splits, block_n)
    lens = [1, 5, 70, 33]
    kc, vc, tables = _paged(gen, lens, 16, 64, spare_columns=2)
    q = _randn(gen, len(lens), NUM_KV_HEADS * 4, 64)
    args = (q, kc, vc, tables, tensor(lens, dtype=torch.int32), 0.125)
    got = ta.paged_decode_attention(*args, num_splits=num_splits, block_n=block_n)
    torch.testing.assert_close(got, ref_attn.paged_decode_attention(*args), **TOL)


def test_decode_split_k_divides_each_sequence_not_the_table():
    """Tables padded far past every context (as CUDA graphs pad them): each sequence splits its
    own context, so all splits of a short sequence hold keys and the merge stays exact."""
    gen = _gen("split-wide")
    lens = [3, 40, 100]
    kc, vc, tables = _paged(gen, lens, 16, 64, spare_columns=40)
    q = _randn(gen, len(lens), NUM_KV_HEADS * 2, 64)
    args = (q, kc, vc, tables, tensor(lens, dtype=torch.int32), 0.125)
    got = ta.paged_decode_attention(*args, num_splits=6, block_n=16)
    torch.testing.assert_close(got, ref_attn.paged_decode_attention(*args), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "group, head_dim, block_size", list(itertools.product(GROUPS, HEAD_DIMS, BLOCK_SIZES))
)
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_long_contexts(group, head_dim, block_size, num_splits):
    gen = _gen("decode-long", group, head_dim, block_size, num_splits)
    lens = [517, 1, 300, 2 * block_size, 129, 64 + 7]
    kc, vc, tables = _paged(gen, lens, block_size, head_dim)
    q = _randn(gen, len(lens), NUM_KV_HEADS * group, head_dim)
    args = (q, kc, vc, tables, tensor(lens), head_dim**-0.5)
    got = ta.paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(got, ref_attn.paged_decode_attention(*args), **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_16bit_inputs(dtype):
    gen = _gen("decode16", dtype)
    lens = [3, 40, 17]
    kc, vc, tables = _paged(gen, lens, 16, 64, dtype=dtype)
    q = _randn(gen, len(lens), NUM_KV_HEADS * 4, 64, dtype=dtype)
    got = ta.paged_decode_attention(q, kc, vc, tables, tensor(lens), 0.125)
    assert got.dtype == dtype
    want = ref_attn.paged_decode_attention(
        q.float(), kc.float(), vc.float(), tables, tensor(lens), 0.125
    )
    torch.testing.assert_close(got.float(), want, **TOL_16)


# -- prefill, chunked prefill, verify -----------------------------------------------------------

# (cached prefix, new queries) in units that stay meaningful for both block sizes.
PREFILL_CASES = {
    "empty-prefix": lambda bs: (0, 13),
    "short-prefix": lambda bs: (bs + 5, 9),
    "long-prefix": lambda bs: (5 * bs + 3, 20),
    "verify-k4": lambda bs: (7 * bs + 1, 5),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("group, head_dim, block_size", SHAPES)
def test_prefill_matches_reference(group, head_dim, block_size, case):
    prefix, chunk = PREFILL_CASES[case](block_size)
    context = prefix + chunk
    gen = _gen("prefill", group, head_dim, block_size, case)
    kc, vc, tables = _paged(gen, [context], block_size, head_dim)
    q = _randn(gen, chunk, NUM_KV_HEADS * group, head_dim)
    args = (q, kc, vc, tables[0], context, head_dim**-0.5)
    want = ref_attn.paged_prefill_attention(*args)
    torch.testing.assert_close(ta.paged_prefill_attention(*args), want, **TOL)
    # Several query tiles per request, narrow key tiles.
    torch.testing.assert_close(
        ta.paged_prefill_attention(*args, block_m=16, block_n=16), want, **TOL
    )


@pytest.mark.slow
@pytest.mark.parametrize("prefix, chunk", [(0, 150), (1000, 64), (777, 5), (2048 + 3, 33)])
@pytest.mark.parametrize("group", GROUPS)
def test_prefill_long(prefix, chunk, group):
    gen = _gen("prefill-long", prefix, chunk, group)
    context = prefix + chunk
    kc, vc, tables = _paged(gen, [context], 32, 128)
    q = _randn(gen, chunk, NUM_KV_HEADS * group, 128)
    args = (q, kc, vc, tables[0], context, 128**-0.5)
    torch.testing.assert_close(
        ta.paged_prefill_attention(*args), ref_attn.paged_prefill_attention(*args), **TOL
    )


def _varlen_batch(gen, block_size, head_dim, group, dtype=torch.float32):
    """Decode, prefill from 0, a chunk over a prefix, a verify step, decode: one launch."""
    queries_and_contexts = [
        (1, 2 * block_size + 3),
        (11, 11),
        (9, 3 * block_size + 1),
        (5, 6 * block_size + 7),
        (1, 1),
    ]
    q_lens = [n for n, _ in queries_and_contexts]
    lens = [c for _, c in queries_and_contexts]
    kc, vc, tables = _paged(gen, lens, block_size, head_dim, dtype=dtype)
    cu = tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = _randn(gen, sum(q_lens), NUM_KV_HEADS * group, head_dim, dtype=dtype)
    return q, kc, vc, tables, cu, tensor(lens), max(q_lens)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_m", [None, 16])
def test_varlen_batch_matches_per_request_reference(group, block_m):
    gen = _gen("varlen", group, block_m)
    q, kc, vc, tables, cu, lens, max_q = _varlen_batch(gen, 16, 64, group)
    got = ta.paged_attention_varlen(q, kc, vc, tables, cu, lens, max_q, 0.125, block_m=block_m)
    for r in range(len(lens)):
        rows = slice(int(cu[r]), int(cu[r + 1]))
        want = ref_attn.paged_prefill_attention(q[rows], kc, vc, tables[r], int(lens[r]), 0.125)
        torch.testing.assert_close(got[rows], want, **TOL)
    with dispatch.force_backend("torch"):  # the fallback that loops over the reference
        fallback = dispatch.paged_attention_varlen(q, kc, vc, tables, cu, lens, max_q, 0.125)
    torch.testing.assert_close(got, fallback, **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_16bit_inputs(dtype):
    gen = _gen("varlen16", dtype)
    q, kc, vc, tables, cu, lens, max_q = _varlen_batch(gen, 16, 64, 4, dtype=dtype)
    got = ta.paged_attention_varlen(q, kc, vc, tables, cu, lens, max_q, 0.125)
    assert got.dtype == dtype
    with reference_backend():
        want = dispatch.paged_attention_varlen(
            q.float(), kc.float(), vc.float(), tables, cu, lens, max_q, 0.125
        )
    torch.testing.assert_close(got.float(), want, **TOL_16)


@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (8, 64)])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_causal_attention_matches_reference(group, head_dim, num_tokens):
    gen = _gen("causal", group, head_dim, num_tokens)
    # Strided K/V views of a fused projection.
    kv = _randn(gen, num_tokens, 2, NUM_KV_HEADS, head_dim)
    k, v = kv.unbind(1)
    q = _randn(gen, num_tokens, NUM_KV_HEADS * group, head_dim)
    torch.testing.assert_close(
        ta.causal_attention(q, k, v, 0.1), ref_attn.causal_attention(q, k, v, 0.1), **TOL
    )
    torch.testing.assert_close(
        ta.causal_attention(q, k, v, 0.1, block_m=16, block_n=16),
        ref_attn.causal_attention(q, k, v, 0.1),
        **TOL,
    )


# -- RMSNorm -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 64), (3, 96), (5, 3, 128), (1, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(shape, dtype):
    gen = _gen("norm", shape, dtype)
    weight = _randn(gen, shape[-1], dtype=dtype)
    # A strided view: rows of a wider buffer, like q/k heads sliced out of the qkv projection.
    wide = _randn(gen, *shape[:-1], shape[-1] + 32, dtype=dtype)
    x = wide[..., 16 : 16 + shape[-1]]
    got, want = tn.rms_norm(x, weight, 1e-6), ref_norm.rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **(TOL if dtype == torch.float32 else TOL_16))


@pytest.mark.parametrize("shape", [(7, 64), (4, 3, 128), (2, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_reference(shape, dtype):
    gen = _gen("add-norm", shape, dtype)
    x, residual = _randn(gen, *shape, dtype=dtype), _randn(gen, *shape, dtype=dtype)
    weight = _randn(gen, shape[-1], dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    normed, summed = tn.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = ref_norm.add_rms_norm(x, residual, weight, 1e-5)
    # fp32: the same single add, bit for bit. bf16: the interpreter truncates float32 -> bf16
    # where compiled triton (and torch) round to nearest even, so allow one bf16 ulp here.
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(summed, want_summed, **exact)
    torch.testing.assert_close(normed, want_normed, **(TOL if dtype == torch.float32 else TOL_16))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_float32_weight_on_16bit_input():
    """weight * x.to(dtype) promotes to the weight's dtype, as in the reference."""
    gen = _gen("norm-promote")
    x, weight = _randn(gen, 5, 64, dtype=torch.float16), _randn(gen, 64)
    got, want = tn.rms_norm(x, weight, 1e-6), ref_norm.rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL)


# -- rotary --------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (8, 64)])
def test_rotary_matches_reference(scaling, group, head_dim):
    gen = _gen("rope", scaling is None, group, head_dim)
    cos_table, sin_table = _on_device(
        *ref_rope.rope_cos_sin(ref_rope.rope_inv_freq(head_dim, 500000.0, scaling), 1024)
    )
    num_tokens = 9
    positions = torch.randint(0, 1024, (num_tokens,), generator=gen).to(DEVICE)
    qkv = _randn(gen, num_tokens, (NUM_KV_HEADS * group + 2 * NUM_KV_HEADS) * head_dim)
    q_size = NUM_KV_HEADS * group * head_dim
    q = qkv[:, :q_size].view(num_tokens, -1, head_dim)  # strided views, as in the model
    k = qkv[:, q_size : q_size + NUM_KV_HEADS * head_dim].view(num_tokens, -1, head_dim)
    cos, sin = cos_table[positions], sin_table[positions]
    want_q, want_k = ref_rope.apply_rotary(q, k, cos, sin)
    got_q, got_k = tn.apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)
    got_q, got_k = tn.apply_rotary_by_position(q, k, cos_table, sin_table, positions)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)


def test_rotary_bfloat16():
    gen = _gen("rope-bf16")
    cos_table, sin_table = _on_device(
        *ref_rope.rope_cos_sin(ref_rope.rope_inv_freq(64, 1e4, LLAMA3), 256)
    )
    positions = torch.randint(0, 256, (6,), generator=gen).to(DEVICE)
    q = _randn(gen, 6, 8, 64, dtype=torch.bfloat16)
    k = _randn(gen, 6, 2, 64, dtype=torch.bfloat16)
    cos = cos_table[positions].to(torch.bfloat16)
    sin = sin_table[positions].to(torch.bfloat16)
    for got, want in zip(tn.apply_rotary(q, k, cos, sin), ref_rope.apply_rotary(q, k, cos, sin)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), **TOL_16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (3, 96)])
def test_qk_norm_rotary_matches_the_three_launches(dtype, group, head_dim):
    """One launch for q norm, k norm and rotary: the values of rms_norm then apply_rotary
    (triton), within an ulp (the head's sum of squares is taken in halves), and of the torch
    references; q and k may be strided views of one fused qkv row, as the model passes them."""
    gen = _gen("qk-norm-rope", dtype, group, head_dim)
    tokens, kv_heads = 5, 2
    q_size, kv_size = kv_heads * group * head_dim, kv_heads * head_dim
    qkv = _randn(gen, tokens, q_size + 2 * kv_size, dtype=dtype) * 3
    q = qkv[:, :q_size].view(tokens, kv_heads * group, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    q_w, k_w = (1 + _randn(gen, head_dim) / 4).to(dtype), (1 + _randn(gen, head_dim) / 4).to(dtype)
    cos_table, sin_table = _on_device(
        *ref_rope.rope_cos_sin(ref_rope.rope_inv_freq(head_dim, 1e6, None), 64)
    )
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    cos, sin = cos_table[positions].to(dtype), sin_table[positions].to(dtype)
    got = tn.qk_norm_rotary(q, k, q_w, k_w, 1e-6, cos, sin)
    chain = tn.apply_rotary(tn.rms_norm(q, q_w, 1e-6), tn.rms_norm(k, k_w, 1e-6), cos, sin)
    want = ref_rope.apply_rotary(
        ref_norm.rms_norm(q, q_w, 1e-6), ref_norm.rms_norm(k, k_w, 1e-6), cos, sin
    )
    ulp = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    for g, c, w in zip(got, chain, want):
        assert g.dtype == dtype and g.shape == c.shape
        torch.testing.assert_close(g.float(), c.float(), **ulp)
        torch.testing.assert_close(
            g.float(), w.float(), **(TOL if dtype == torch.float32 else TOL_16)
        )


def test_qk_norm_rotary_refuses_weights_of_another_dtype():
    q, k = torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    cos = torch.ones(2, 64, dtype=torch.bfloat16)
    q, k, cos, w = _on_device(q, k, cos, torch.ones(64))
    with pytest.raises(ValueError, match="dtype"):
        tn.qk_norm_rotary(q, k, w, w, 1e-6, cos, cos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 96), (7, 2 * 1536), (2, 3, 2 * 40)])
def test_silu_and_mul_matches_reference(dtype, shape):
    """One pass over gate_up: the reference's rounding steps (silu rounded to the dtype, then the
    product), including a width that is not a multiple of the block and a 3-D batch."""
    gate_up = _randn(_gen("silu", dtype, shape), *shape, dtype=dtype) * 4
    got = tact.silu_and_mul(gate_up)
    want = ref_act.silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(
        got.float(), want.float(), **(TOL if dtype == torch.float32 else TOL_16)
    )


# -- sampling race ---------------------------------------------------------------------------------


def _race_want(probs: torch.Tensor, keys: torch.Tensor) -> list[int]:
    from stoker.services.worker.sampling_noise import _noise_torch

    return (probs / _noise_torch(keys, probs.shape[-1])).max(dim=-1).indices.tolist()


@pytest.mark.parametrize("rows, vocab", [(1, 7), (5, 2048), (3, 4099), (4, 49152)])
def test_race_sample_matches_the_materialised_noise(rows, vocab, monkeypatch):
    """The fused race draws the torch twin's noise bits, so it picks the same tokens; filtered
    (zero) tokens never win, and a row with one survivor always picks it."""
    monkeypatch.setattr(
        ts, "_empty", lambda shape, dtype, device: torch.full(shape, -1, device=device)
    )
    gen = _gen("race", rows, vocab)
    probs = (torch.rand(rows, vocab, generator=gen) ** 4).to(DEVICE)
    probs[0, : vocab // 2] = 0.0
    if rows > 1:
        probs[1] = 0.0
        probs[1, vocab - 1] = 0.5
    keys = torch.randint(0, (1 << 63) - 1, (rows,), generator=gen).to(DEVICE)
    got = ts.race_sample(probs, keys).tolist()
    assert got == _race_want(probs, keys)
    assert all(probs[r, t] > 0 for r, t in enumerate(got))
    if rows > 1:
        assert got[1] == vocab - 1


def test_sampler_race_through_the_triton_kernel_matches_torch():
    """Sampler end to end (temperature, top-p, min-p, a seeded row) with the race forced onto
    the kernel: the tokens the materialised-noise path picks."""
    from stoker.common.sampling_params import SamplingParams
    from stoker.services.worker.sampler import Sampler, SamplingBatch

    vocab = 3000
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.05),
    ]
    logits = _randn(_gen("sampler-race"), len(params), vocab) * 3
    batch = SamplingBatch.make(params, [0, 5, 0, 2], vocab, DEVICE)
    with reference_backend():
        want = Sampler(torch.Generator(DEVICE).manual_seed(3))(logits, batch).token_ids
    assert dispatch.race_sample(torch.rand(2, 5), torch.zeros(2, dtype=torch.int64)) is None
    with dispatch.force_triton():
        got = Sampler(torch.Generator(DEVICE).manual_seed(3))(logits, batch).token_ids
    assert got.tolist() == want.tolist()


# -- dispatch ------------------------------------------------------------------------------------


def test_dispatch_picks_torch_on_cpu_and_triton_when_forced(monkeypatch):
    monkeypatch.delenv(dispatch.FORCE_TORCH_ENV, raising=False)
    x = torch.randn(2, 8)
    assert dispatch.backend_for(x) == "torch"
    with dispatch.force_triton():
        assert dispatch.backend_for(x) == "triton"
        with dispatch.force_backend("torch"):
            assert dispatch.backend_for(x) == "torch"
        assert dispatch.backend_for(x) == "triton"
    assert dispatch.backend_for(x) == "torch"
    fake_cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert dispatch._use_triton(fake_cuda)
    assert not dispatch._use_triton(SimpleNamespace(is_cuda=True, dtype=torch.float64))
    assert not dispatch._use_triton(fake_cuda, SimpleNamespace(dtype=torch.float32))
    monkeypatch.setenv(dispatch.FORCE_TORCH_ENV, "1")
    assert not dispatch._use_triton(fake_cuda)
    with pytest.raises(ValueError), dispatch.force_backend("cuda"):
        pass


def test_dispatch_forced_triton_matches_torch_path():
    gen = _gen("dispatch")
    x, residual, weight = _randn(gen, 4, 64), _randn(gen, 4, 64), _randn(gen, 64)
    q, k = _randn(gen, 4, 4, 64), _randn(gen, 4, 2, 64)
    cos_table, sin_table = _on_device(
        *ref_rope.rope_cos_sin(ref_rope.rope_inv_freq(64, 1e4, None), 32)
    )
    positions = tensor([0, 3, 31, 7])
    kc, vc, tables = _paged(gen, [20, 7], 16, 64)
    calls = {
        "rms_norm": lambda: dispatch.rms_norm(x, weight, 1e-6),
        "add_rms_norm": lambda: dispatch.add_rms_norm(x, residual, weight, 1e-6),
        "rotary": lambda: dispatch.apply_rotary_by_position(q, k, cos_table, sin_table, positions),
        "silu_and_mul": lambda: dispatch.silu_and_mul(torch.cat([x, residual], dim=-1)),
        "qk_norm_rotary": lambda: dispatch.qk_norm_rotary(
            q, k, weight, -weight, 1e-6, cos_table[positions], sin_table[positions]
        ),
        "decode": lambda: dispatch.paged_decode_attention(
            q[:2], kc, vc, tables, tensor([20, 7]), 0.125
        ),
        "prefill": lambda: dispatch.paged_prefill_attention(q, kc, vc, tables[0], 20, 0.125),
        "causal": lambda: dispatch.causal_attention(q, k, -k, 0.125),
    }
    for name, call in calls.items():
        with reference_backend():
            want = call()
        with dispatch.force_triton():
            got = call()
        torch.testing.assert_close(got, want, **TOL, msg=name)


def test_package_imports_and_runs_without_triton():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch
        from stoker.kernels import dispatch
        x = torch.randn(3, 8)
        torch.testing.assert_close(dispatch.rms_norm(x, torch.ones(8), 1e-6),
                                   x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert "stoker.kernels.triton_attention" not in sys.modules
        assert not dispatch.triton_available()
        try:
            with dispatch.force_triton():
                raise SystemExit("forcing triton without triton must fail")
        except RuntimeError:
            pass
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- the whole model -----------------------------------------------------------------------------


@cpu_only  # on CUDA the engine runs triton anyway: gpu_check's hf and paths phases
def test_tiny_model_forced_triton_matches_torch(tmp_path, monkeypatch):
    """Greedy tokens and logprobs of a tiny qwen3 (q/k norm, GQA 4) through the engine, with the
    model's kernels swapped for dispatch's forced onto triton: prefill from 0, chunked prefill
    and prefix-cache hits (paged prefill over a prefix) and batched decode all run."""
    from stoker.common.sampling_params import SamplingParams
    from stoker.kernels import cpu_ops
    from stoker.services.engine import LLM
    from stoker.services.worker.models import layers
    from tests.factory import make_model

    path = make_model(
        tmp_path / "model", "qwen3", head_dim=64, num_heads=4, num_kv_heads=1, with_tokenizer=True
    )
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *args: None)  # no native build
    prefix = [(7 * i) % 400 + 3 for i in range(37)]
    # Chunks of at most 16 tokens after a prefix take the decode path (step_inputs); the 20-token
    # tail after a prefix hit keeps the paged prefill path covered.
    tail = list(range(21, 41))
    prompts = [prefix + [11, 12, 13], prefix + tail, [5, 6, 7, 8, 9], prefix[:20] + [99]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    options = dict(num_kv_blocks=48, block_size=16, max_num_batched_tokens=32, max_model_len=128)

    def run():
        outs = LLM(str(path), **options).generate(prompts, params)
        return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]

    want_ids, want_lps = run()

    kernels = (
        "store_kv",
        "paged_decode_attention",
        "paged_prefill_attention",
        "causal_attention",
        "rms_norm",
        "add_rms_norm",
        "qk_norm_rotary",
        "silu_and_mul",
    )
    for name in kernels:
        monkeypatch.setattr(layers, name, getattr(dispatch, name))
    counts: dict[str, int] = {}

    def counting(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
        counting(ta, name)
    for name in ("causal_attention", "rms_norm", "add_rms_norm", "qk_norm_rotary"):
        counting(ta if name == "causal_attention" else tn, name)
    counting(tact, "silu_and_mul")
    with dispatch.force_triton():
        got_ids, got_lps = run()
    assert set(counts) == set(kernels), counts  # every kernel ran on triton
    assert got_ids == want_ids
    for got, want in zip(got_lps, want_lps):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)


# -- compile for the GPU -------------------------------------------------------------------------

COMPILE_SCRIPT = """
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stoker.kernels import triton_attention as ta, triton_norm_rope as tn, triton_sampling as ts
from stoker.kernels import triton_activation as tact

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
BACKEND = triton.compiler.make_backend(TARGET)
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.int32: "i32", torch.int64: "i64"}
built = set()


class Compile:
    # Stands in for a @triton.jit kernel: `kernel[grid](...)` compiles what the host wrapper
    # would launch, with the wrapper's own arguments and constexprs, and runs nothing.
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, **consts):
            sig = {}
            for name, arg in zip(self.kernel.arg_names, args):
                if isinstance(arg, torch.Tensor):
                    sig[name] = "*" + TYPES[arg.dtype]
                elif isinstance(arg, float):
                    sig[name] = "fp32"
                else:
                    sig[name] = "i64" if abs(arg) >= 2**31 else "i32"
            sig.update({name: "constexpr" for name in consts})
            key = (self.kernel.__name__, str(sig), str(sorted(consts.items())), num_warps)
            if key not in built:
                built.add(key)
                options = BACKEND.parse_options({"num_warps": num_warps}).__dict__
                triton.compile(ASTSource(self.kernel, sig, consts), target=TARGET, options=options)
        return launch


for module in (ta, tn, ts, tact):
    for name, obj in list(vars(module).items()):
        if name.endswith("_kernel") and isinstance(obj, triton.runtime.JITFunction):
            setattr(module, name, Compile(obj))  # launched kernels; jit helpers stay

for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for group, d, bs in ((1, 64, 16), (8, 128, 32), (4, 128, 16)):
        hk = 2
        kc = torch.empty(8, bs, hk, d, dtype=dtype)
        tables = torch.zeros(2, 4, dtype=torch.int64)
        lens = torch.ones(2, dtype=torch.int64)
        q = torch.empty(2, hk * group, d, dtype=dtype)
        ta.store_kv(kc, kc, q[:, :hk], q[:, :hk], lens)
        for splits in (1, 4):
            ta.paged_decode_attention(q, kc, kc, tables, lens, 0.1, num_splits=splits)
        ta.paged_prefill_attention(q, kc, kc, tables[0], 9, 0.1)
        cu = torch.zeros(3, dtype=torch.int32)
        ta.paged_attention_varlen(q, kc, kc, tables, cu, lens, 2, 0.1)
        ta.causal_attention(q, q[:, :hk], q[:, :hk], 0.1)
        cos = torch.empty(4, d)
        tn.apply_rotary(q, q[:, :hk], cos, cos)
        tn.apply_rotary_by_position(q, q[:, :hk], cos, cos, lens)
        w = torch.empty(d, dtype=dtype)
        tn.qk_norm_rotary(q, q[:, :hk], w, w, 1e-6, cos.to(dtype), cos.to(dtype))
    for hidden in (128, 4096, 8192):
        x = torch.empty(2, hidden, dtype=dtype)
        tn.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6)
        tn.add_rms_norm(x, x, torch.empty(hidden, dtype=dtype), 1e-6)
    tn.rms_norm(torch.empty(2, 4, 128, dtype=dtype), torch.empty(128), 1e-6)
    tact.silu_and_mul(torch.empty(2, 2 * 3072, dtype=dtype))
ts.race_sample(torch.empty(2, 151936), torch.zeros(2, dtype=torch.int64))
print("ok", len(built))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Compiles what the host wrappers launch (three dtypes, GQA 1/4/8, head dims 64/128, every
    constexpr branch) to sm_90 cubins with triton's bundled ptxas: no GPU needed. Catches what
    the interpreter accepts but the compiler rejects (non-constexpr globals, dot shapes, types)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-4000:]
