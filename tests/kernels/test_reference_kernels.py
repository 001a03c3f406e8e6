"""Kernel references against naive per-token implementations, and native CPU kernels against
the references."""

from __future__ import annotations

import math

import pytest
import torch

from stoker.kernels import cpu_ops
from stoker.kernels.paged_attention import (
    causal_attention,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)
from stoker.kernels.rms_norm import add_rms_norm, rms_norm
from stoker.kernels.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from tests.kernels.paged_cache import random_paged_cache


def _naive(q, kc, vc, table, positions, context_len, scale):
    """Attention for query rows at `positions`, reading keys slot by slot."""
    block_size, hk = kc.shape[1], kc.shape[2]
    group = q.shape[1] // hk
    keys = torch.stack([kc[table[t // block_size], t % block_size] for t in range(context_len)])
    vals = torch.stack([vc[table[t // block_size], t % block_size] for t in range(context_len)])
    out = torch.empty_like(q)
    for i, pos in enumerate(positions):
        for h in range(q.shape[1]):
            k, v = keys[: pos + 1, h // group], vals[: pos + 1, h // group]
            p = torch.softmax((k @ q[i, h]) * scale, dim=0)
            out[i, h] = p @ v
    return out


@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_reference_matches_naive(hq, hk, block_size):
    lens = [1, 7, block_size, 3 * block_size + 5]
    kc, vc, tables = random_paged_cache(len(lens), hk, 32, block_size, lens)
    q = torch.randn(len(lens), hq, 32)
    got = paged_decode_attention(q, kc, vc, tables, torch.tensor(lens), 0.2)
    for i, n in enumerate(lens):
        want = _naive(q[i : i + 1], kc, vc, tables[i], [n - 1], n, 0.2)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix, chunk", [(0, 9), (16, 9), (21, 3), (40, 17)])
def test_prefill_over_cached_prefix_matches_naive(prefix, chunk):
    context = prefix + chunk
    kc, vc, tables = random_paged_cache(1, 2, 32, 16, [context], seed=1)
    q = torch.randn(chunk, 8, 32)
    got = paged_prefill_attention(q, kc, vc, tables[0], context, 0.3)
    want = _naive(q, kc, vc, tables[0], list(range(prefix, context)), context, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_causal_attention_equals_paged_prefill_from_zero():
    kc, vc, tables = random_paged_cache(1, 2, 16, 8, [20], seed=2)
    slots = torch.tensor([tables[0, t // 8] * 8 + t % 8 for t in range(20)])
    k, v, q = torch.randn(20, 2, 16), torch.randn(20, 2, 16), torch.randn(20, 4, 16)
    store_kv(kc, vc, k, v, slots)
    torch.testing.assert_close(
        causal_attention(q, k, v, 0.25),
        paged_prefill_attention(q, kc, vc, tables[0], 20, 0.25),
        rtol=1e-5,
        atol=1e-5,
    )


def test_store_kv_writes_exactly_the_slots():
    kc = torch.zeros(4, 8, 2, 4)
    vc = torch.zeros(4, 8, 2, 4)
    slots = torch.tensor([3, 17, 30])
    k = torch.randn(3, 2, 4)
    store_kv(kc, vc, k, -k, slots)
    flat_k, flat_v = kc.view(-1, 2, 4), vc.view(-1, 2, 4)
    torch.testing.assert_close(flat_k[slots], k)
    torch.testing.assert_close(flat_v[slots], -k)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].abs().sum() == 0


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("rows, inter", [(1, 16), (7, 40), (33, 1536), (300, 8)])
def test_native_silu_and_mul_equals_the_reference(rows, inter):
    """Within float32 rounding of torch's silu(gate) * up, from a strided view of a wider
    projection too, and at inputs whose exp overflows or underflows."""
    from stoker.kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * inter + 6, generator=gen) * 6
    wide[0, 3:7] = torch.tensor([120.0, -120.0, 0.0, 1e-30])  # the first gate values
    gate_up = wide[:, 3 : 3 + 2 * inter]
    got = cpu_ops.silu_and_mul(gate_up)
    assert got is not None and got.shape == (rows, inter)
    torch.testing.assert_close(got, silu_and_mul(gate_up), rtol=2e-6, atol=1e-30)
    assert cpu_ops.silu_and_mul(gate_up.double()) is None  # other dtypes: the reference


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_kv_equals_the_reference(dtype):
    """From views into a fused qkv projection (rows strided), as the attention block passes
    them; the reference's result bit for bit, and nothing else touched."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 12 * 8 + 2 * 3 * 8, generator=gen).to(dtype)
    k = qkv[:, 96:120].view(5, 3, 8)
    v = qkv[:, 120:].view(5, 3, 8)
    slots = torch.tensor([0, 9, 33, 34, 63])
    want_k, want_v = torch.randn(2, 4, 16, 3, 8, generator=gen).to(dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    store_kv(want_k, want_v, k, v, slots)
    assert cpu_ops.store_kv(got_k, got_v, k, v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.store_kv(got_k, got_v, k, v, torch.tensor([0, 1, 2, 3, 64]))


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize(
    "hq, hk, d, block_size",
    [(12, 4, 64, 16), (8, 8, 32, 16), (16, 2, 128, 32), (4, 2, 16, 8), (8, 1, 256, 16)],
)
@pytest.mark.parametrize("lens", [[1, 5, 15, 16, 17, 33, 100, 257], [40], [3, 77]])
def test_native_decode_matches_reference(hq, hk, d, block_size, lens):
    # Context lengths around the kernel's 16-token chunks and the block boundaries; few requests
    # take the kernel's one-task-per-kv-head split, many its one-task-per-request path.
    kc, vc, tables = random_paged_cache(len(lens), hk, d, block_size, lens, seed=3)
    q = torch.randn(len(lens), hq, d) * 3  # peaky softmax: the online max rescaling matters
    args = (q, kc, vc, tables, torch.tensor(lens), d**-0.5)
    native = cpu_ops.paged_decode_attention(*args)
    assert native is not None
    torch.testing.assert_close(native, paged_decode_attention(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("hq, hk, d, block_size", [(9, 3, 64, 16), (8, 8, 32, 16), (8, 1, 256, 16)])
def test_native_decode_reads_a_bfloat16_cache(hq, hk, d, block_size):
    # The kernel computes on the exact bfloat16 values with float32 sums (K/V widened, or q.k as
    # vdpbf16ps's exact products on AVX512-BF16 CPUs), so it must equal float32 attention over
    # the same bfloat16-rounded values, up to the output's one rounding and the order of sums.
    lens = [1, 17, 40, 100, 257]
    kc, vc, tables = random_paged_cache(len(lens), hk, d, block_size, lens, seed=5)
    q = (torch.randn(len(lens), hq, d) * 3).bfloat16()
    kc, vc = kc.bfloat16(), vc.bfloat16()
    args = (tables, torch.tensor(lens), d**-0.5)
    native = cpu_ops.paged_decode_attention(q, kc, vc, *args)
    assert native is not None and native.dtype == torch.bfloat16
    want = paged_decode_attention(q.float(), kc.float(), vc.float(), *args)
    torch.testing.assert_close(native, want.bfloat16(), rtol=1e-2, atol=1e-2)
    assert (native.float() - want).abs().max() <= want.abs().max() * 2**-8  # bf16's half ulp
    mixed = (q, kc.float(), vc.float(), *args)
    assert cpu_ops.paged_decode_attention(*mixed) is None  # one dtype for all, or the reference


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("hq, hk, d", [(12, 1, 64), (4, 4, 48)])
def test_native_decode_declines_shapes_without_a_kernel(hq, hk, d):
    """Groups over 8 and head dims that are not a multiple of 16 fall back to the reference."""
    kc, vc, tables = random_paged_cache(2, hk, d, 16, [3, 20], seed=1)
    args = (torch.randn(2, hq, d), kc, vc, tables, torch.tensor([3, 20]), d**-0.5)
    assert cpu_ops.paged_decode_attention(*args) is None


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, res = torch.randn(5, 64), torch.randn(5, 64)
    ref = LlamaRMSNorm(64, eps=1e-5)
    ref.weight.data = torch.randn(64)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))
        normed, summed = add_rms_norm(x, res, ref.weight, 1e-5)
        assert torch.equal(summed, x + res) and torch.equal(normed, ref(x + res))


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_scaling=scaling)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_inv_freq(64, config.rope_parameters["rope_theta"], scaling)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


def test_rotary_rotates_pairs_by_position():
    inv_freq = rope_inv_freq(8, 10000.0, None)
    cos, sin = rope_cos_sin(inv_freq, 16)
    q = torch.randn(3, 2, 8)
    k = torch.randn(3, 1, 8)
    pos = torch.tensor([0, 5, 15])
    rq, rk = apply_rotary(q, k, cos[pos], sin[pos])
    torch.testing.assert_close(rq[0], q[0])  # position 0 is the identity
    angle = 5 * inv_freq[1].item()
    x, y = q[1, 0, 1].item(), q[1, 0, 5].item()  # pair (i, i + d/2)
    assert rq[1, 0, 1].item() == pytest.approx(x * math.cos(angle) - y * math.sin(angle), abs=1e-5)
    assert rq[1, 0, 5].item() == pytest.approx(y * math.cos(angle) + x * math.sin(angle), abs=1e-5)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1))


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("rows, hidden", [(1, 64), (37, 320), (130, 768)])
def test_native_norms_match_reference(rows, hidden):
    from stoker.kernels.rms_norm import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    out, summed = cpu_ops.add_rms_norm(x, residual, w, 1e-5)
    want_out, want_summed = add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(out, want_out)


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("hq, hk, d", [(12, 4, 64), (5, 5, 64), (4, 2, 128)])
def test_native_rotary_is_bitwise_the_reference(hq, hk, d):
    """On views into a fused qkv row (as the model passes them), rounding as the reference."""
    from stoker.kernels.rotary import apply_rotary, rope_cos_sin, rope_inv_freq

    tokens = 19
    qkv = torch.randn(tokens, (hq + 2 * hk) * d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hk, d)
    cos, sin = rope_cos_sin(rope_inv_freq(d, 10000.0, None), 64)
    positions = torch.randint(0, 64, (tokens,))
    before = qkv.clone()
    want_q, want_k = apply_rotary(q, k, cos[positions], sin[positions])
    got_q, got_k = cpu_ops.apply_rotary(q, k, cos[positions], sin[positions])
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv, before)  # inputs untouched


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("rows, hidden", [(1, 64), (37, 576), (130, 768)])
def test_native_bfloat16_norms_round_as_the_reference(rows, hidden):
    """bfloat16 rows: the same rounding points as the reference's ops; only the float32 sum of
    squares may add up in another order, which can move a result by one bfloat16 step."""
    from stoker.kernels.rms_norm import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16()
    w = torch.randn(hidden, generator=gen).bfloat16()
    got = cpu_ops.rms_norm(x, w, 1e-6)
    want = rms_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() < 0.01  # nearly all bitwise
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)
    out, summed = cpu_ops.add_rms_norm(x, residual, w, 1e-5)
    want_out, want_summed = add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(summed, want_summed)  # one rounded add, as the reference
    torch.testing.assert_close(out, want_out, rtol=2**-7, atol=1e-2)


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
def test_native_bfloat16_rotary_is_bitwise_the_reference():
    from stoker.kernels.rotary import apply_rotary, rope_cos_sin, rope_inv_freq

    tokens, hq, hk, d = 19, 9, 3, 64
    qkv = torch.randn(tokens, (hq + 2 * hk) * d).bfloat16()
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hk, d)
    cos, sin = rope_cos_sin(rope_inv_freq(d, 10000.0, None), 64)
    positions = torch.randint(0, 64, (tokens,))
    cos, sin = cos[positions].bfloat16(), sin[positions].bfloat16()  # as the model casts them
    want_q, want_k = apply_rotary(q, k, cos, sin)
    got_q, got_k = cpu_ops.apply_rotary(q, k, cos, sin)
    assert got_q.dtype == torch.bfloat16
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert cpu_ops.apply_rotary(q, k, cos.float(), sin.float()) is None  # mixed: the reference


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
def test_native_decode_rejects_bad_tables_instead_of_reading_stray_memory():
    kc, vc, tables = random_paged_cache(2, 2, 16, 16, [20, 5], seed=2)
    q = torch.randn(2, 4, 16)
    bad = tables.clone()
    bad[0, 1] = kc.shape[0]  # a block id past the pool, inside the first request's context
    with pytest.raises(RuntimeError, match="block id"):
        cpu_ops.paged_decode_attention(q, kc, vc, bad, torch.tensor([20, 5]), 0.25)
    with pytest.raises(RuntimeError, match="context length"):
        cpu_ops.paged_decode_attention(q, kc, vc, tables, torch.tensor([0, 5]), 0.25)


def _prefill_case(spans, hq, hk, d, block_size, dtype=torch.float32, seed=6):
    """Chunks (cached prefix, chunk length) laid out as one call of the native prefill kernel."""
    lens = [prefix + n for prefix, n in spans]
    kc, vc, tables = random_paged_cache(len(spans), hk, d, block_size, lens, seed=seed)
    q = torch.randn(sum(n for _, n in spans), hq, d, generator=torch.Generator().manual_seed(seed))
    bounds = torch.tensor([0] + [int(x) for x in torch.tensor([n for _, n in spans]).cumsum(0)])
    return (q * 3).to(dtype), kc.to(dtype), vc.to(dtype), tables, bounds, torch.tensor(lens)


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize(
    "hq, hk, d, block_size",
    [
        (9, 3, 64, 16),
        (12, 4, 64, 16),
        (8, 8, 32, 8),
        (16, 2, 128, 32),
        (8, 1, 256, 16),
        (4, 2, 16, 8),
    ],
)
@pytest.mark.parametrize(
    "spans",
    [
        [(0, 160)],  # one prompt: rows across three 64-row work items, keys across 32-key blocks
        [(0, 1), (0, 7), (5, 33), (100, 64), (0, 65), (31, 17)],  # many chunks, mixed prefixes
    ],
)
def test_native_prefill_matches_reference(hq, hk, d, block_size, spans):
    q, kc, vc, tables, bounds, lens = _prefill_case(spans, hq, hk, d, block_size)
    got = cpu_ops.prefill_attention(q, kc, vc, tables, bounds, lens, d**-0.5)
    assert got is not None and got.shape == q.shape
    for s, context_len in enumerate(lens.tolist()):
        rows = slice(int(bounds[s]), int(bounds[s + 1]))
        want = paged_prefill_attention(q[rows], kc, vc, tables[s], context_len, d**-0.5)
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)
        if spans[s][0] == 0:  # no cached prefix: also the plain causal attention over its rows
            n = rows.stop - rows.start
            keys = torch.stack([kc[tables[s][t // block_size], t % block_size] for t in range(n)])
            vals = torch.stack([vc[tables[s][t // block_size], t % block_size] for t in range(n)])
            plain = causal_attention(q[rows], keys, vals, d**-0.5)
            torch.testing.assert_close(got[rows], plain, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
def test_native_prefill_reads_a_bfloat16_cache():
    # float32 arithmetic on the bfloat16 values: equal to float32 attention over the same values
    # up to the output's one rounding.
    q, kc, vc, tables, bounds, lens = _prefill_case(
        [(0, 70), (20, 40)], 9, 3, 64, 16, dtype=torch.bfloat16
    )
    got = cpu_ops.prefill_attention(q, kc, vc, tables, bounds, lens, 0.125)
    assert got is not None and got.dtype == torch.bfloat16
    for s, context_len in enumerate(lens.tolist()):
        rows = slice(int(bounds[s]), int(bounds[s + 1]))
        want = paged_prefill_attention(
            q[rows].float(), kc.float(), vc.float(), tables[s], context_len, 0.125
        )
        assert (got[rows].float() - want).abs().max() <= want.abs().max() * 2**-8
    assert cpu_ops.prefill_attention(q, kc.float(), vc.float(), tables, bounds, lens, 0.1) is None


@pytest.mark.skipif(cpu_ops.load() is None, reason="native CPU kernels could not be built here")
def test_native_prefill_declines_head_dims_without_a_kernel_and_rejects_bad_tables():
    q, kc, vc, tables, bounds, lens = _prefill_case([(0, 20)], 4, 4, 48, 16)
    assert cpu_ops.prefill_attention(q, kc, vc, tables, bounds, lens, 0.1) is None
    q, kc, vc, tables, bounds, lens = _prefill_case([(3, 20), (0, 5)], 4, 2, 32, 16)
    bad = tables.clone()
    bad[0, 1] = kc.shape[0]  # past the pool, inside the first chunk's context
    with pytest.raises(RuntimeError, match="block id"):
        cpu_ops.prefill_attention(q, kc, vc, bad, bounds, lens, 0.25)
    with pytest.raises(RuntimeError, match="context length"):
        cpu_ops.prefill_attention(q, kc, vc, tables, bounds, torch.tensor([10, 5]), 0.25)
