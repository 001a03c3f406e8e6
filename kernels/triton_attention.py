"""Paged KV-cache store and attention, triton. The torch references in `paged_attention.py` are
the oracle: tests/kernels/test_triton_kernels.py runs these under the triton interpreter on CPU.
(Past 400 lines on purpose: the store, decode and varlen kernels share the cache layout, the
precision rules and the launch helpers below; each kernel sits beside its launcher.)

Cache layout (as in the reference): [num_blocks, block_size, num_kv_heads, head_dim]; the last
dim must be contiguous, the others may have any stride. Inputs may be float16, bfloat16 or
float32; scores, softmax statistics and the output accumulator are always float32. For float32
inputs every `tl.dot` asks for IEEE precision (no TF32), so results match the reference to
~1e-6; 16-bit inputs feed the tensor cores directly, P is rounded to V's dtype before P @ V.

Kernels and launch shapes
- `store_kv`: grid (T,); one program copies one token's K and V rows, a [Hk, D] tile each, into
  slot `slot_mapping[t]` (block = slot // block_size, offset = slot % block_size). A negative
  slot means a padding token and is skipped.
- `paged_decode_attention`: grid (B, Hk, S). One program owns one sequence and one KV head and
  computes all G = Hq / Hk query heads of that group at once: the Q tile is [BLOCK_G, D] with
  BLOCK_G = max(16, next_pow2(G)) (tl.dot needs M >= 16), so each K/V tile is loaded once per
  group, not once per query head. Keys are walked in tiles of BLOCK_N positions; a tile may span
  several cache blocks, each key's block id is gathered from the block table. Online softmax
  (running max / sum, base-2 exponentials with scale * log2(e) folded in). S > 1 is split-K
  ("flash decoding"): split s covers keys [s * P, (s + 1) * P), P being the sequence's own
  context / S in whole tiles, writes its unnormalised accumulator and (max, sum) to float32
  scratch, and `_decode_reduce_kernel` (grid (B, Hq)) merges them. S is chosen from the launch
  shape only (batch * Hk vs the SM count, and the block table width as the longest possible
  context), so no host sync and CUDA-graph friendly.
- `paged_attention_varlen` / `paged_prefill_attention` / `causal_attention`: one kernel,
  grid (cdiv(max_query_len, BLOCK_Q), R, Hk). Several requests go in one launch: request r's
  queries are rows [cu_seqlens_q[r], cu_seqlens_q[r + 1]) of the flat query, and its keys are
  the first context_lens[r] positions of its block table (cached prefix + earlier chunks + this
  chunk, already stored). The M tile is BLOCK_Q query positions x BLOCK_G heads of one KV group
  (row m -> query m // BLOCK_G, head m % BLOCK_G; BLOCK_M = 64 rows by default). Causality is
  bottom-right: query i of an n-query chunk sits at position context_len - n + i and sees keys
  <= that position, so the same kernel serves prefill from 0, chunked prefill over a cached
  prefix, the speculative verify step (k + 1 queries per request) and, with one query per
  request, decode. Programs whose query tile lies past their request's length return at once.
  With PAGED=False the keys are the chunk's own contiguous K/V rows (`causal_attention`).
- Every attention kernel takes `window` (sliding-window layers: a query at position p sees keys
  in (p - window, p], so the key loop starts at the tile's first visible key) and `softcap`
  (Gemma 2: scores become tanh(s / softcap) * softcap before the softmax); both are switched on
  by constexpr flags, so layers without them compile to the same code as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Finite "minus infinity" for running maxima, so a row with no visible key never computes
# inf - inf = NaN. A module global must be a tl.constexpr to be readable inside @triton.jit.
_NEG = tl.constexpr(-1.0e30)


def _dot_precision(dtype: torch.dtype) -> str | None:
    if dtype == torch.float32 or _upcast_dots(dtype):
        return "ieee"
    return None  # 16-bit operands: the backend default (tensor cores, float32 accumulation)


def _upcast_dots(dtype: torch.dtype) -> bool:
    """The triton interpreter multiplies bfloat16 dot operands as raw uint16 bit patterns
    (triton-lang/triton#11584, unsupported upstream), so under the interpreter only, bfloat16
    Q/K/V are widened to float32 before the dots. Compiled kernels never take this branch."""
    return dtype == torch.bfloat16 and _interpreted()


def _interpreted() -> bool:
    return type(_store_kv_kernel).__name__ == "InterpretedFunction"


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("caches must be [num_blocks, block_size, num_kv_heads, head_dim]")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous")


def _tile(value: int, name: str) -> int:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")
    return value


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _softcap(scores, softcap):
    """tanh(s / c) * c through exp (tl has no portable tanh): tanh(x) = 1 - 2 / (exp(2x) + 1),
    which saturates cleanly at +-1 when exp overflows or underflows."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * (scores / softcap)) + 1.0))


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and scratch buffer comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# -- KV-cache store ------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KC,
    VC,
    SLOTS,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = KC + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = VC + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(VC.dtype.element_ty), mask=mask)


def store_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hk, D] into flat slots (block_id * block_size + offset); in place.
    Slots < 0 are skipped (padding tokens)."""
    _check_cache(key_cache, value_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_heads, head_dim = key_cache.shape
    key, value = _last_contiguous(key), _last_contiguous(value)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_size,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# -- decode --------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    Q,
    KC,
    VC,
    BT,
    CL,
    OUT,
    M_PART,
    L_PART,
    ACC_PART,
    scale_log2,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_btb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    num_splits = tl.num_programs(2)
    ctx = tl.load(CL + b).to(tl.int32)
    # Each sequence splits its own context evenly (whole tiles per split): with tables padded to
    # the longest possible context (CUDA graphs), splitting the table width would leave short
    # sequences' work on one split. Splits past the context write an empty (max, sum) = (-inf, 0).
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx - window, 0)
    partition = tl.cdiv(tl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + s * partition
    end = tl.minimum(ctx, start + partition)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = BT + b64 * stride_btb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        blk = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        off = (n % PAGE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = KC + (blk * stride_kcb + off * stride_kcs + kvh * stride_kch)[:, None] + d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        if HAS_SOFTCAP:  # in base 2: c * tanh(s / c) * log2(e) with c, s both times log2(e)
            scores = _softcap(scores, softcap)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = VC + (blk * stride_vcb + off * stride_vcs + kvh * stride_vch)[:, None] + d[None, :]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        row = (b64 * (tl.num_programs(1) * GROUP) + heads) * num_splits + s  # [B, Hq, S]
        tl.store(M_PART + row, m_i, mask=g_mask)
        tl.store(L_PART + row, l_i, mask=g_mask)
        tl.store(ACC_PART + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty context gives zeros, not NaN
        out = acc / l_safe[:, None]
        o_ptrs = OUT + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    M_PART,
    L_PART,
    ACC_PART,
    OUT,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64) * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    m = tl.load(M_PART + row * num_splits + s, mask=s_mask, other=_NEG)
    l_part = tl.load(L_PART + row * num_splits + s, mask=s_mask, other=0.0)
    acc_ptrs = ACC_PART + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :]
    acc = tl.load(acc_ptrs, mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    total = tl.sum(l_part * w, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    o_ptrs = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=d < HEAD_DIM)


def _decode_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, device) -> int:
    """Split-K only when (sequence, KV head) programs cannot fill the GPU; decided from shapes."""
    if device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    by_occupancy = triton.cdiv(2 * sms, programs)
    by_length = triton.cdiv(max_context, 4 * block_n)  # at least ~4 key tiles per split
    return max(1, min(by_occupancy, by_length, 32))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """One query token per request. query [B, Hq, D]; block_tables [B, max_blocks] (padded with
    any valid block id); context_lens [B] include the query token. Returns [B, Hq, D].
    `num_splits` / `block_n` override the launch heuristics (tests)."""
    _check_cache(key_cache, value_cache)
    query = _last_contiguous(query)
    batch, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    group = num_heads // num_kv_heads
    out = _empty(query.shape, query.dtype, query.device)
    if batch == 0:
        return out
    block_n = _tile(block_n or (64 if head_dim <= 128 else 32), "block_n")
    max_context = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = _decode_splits(batch, num_kv_heads, max_context, block_n, query.device)
    # Each split gets at least one whole tile of the longest possible context.
    num_splits = max(1, min(num_splits, triton.cdiv(max_context, block_n)))
    split = num_splits > 1
    if split:
        m_part = _empty((batch, num_heads, num_splits), torch.float32, query.device)
        l_part = _empty((batch, num_heads, num_splits), torch.float32, query.device)
        acc_part = _empty((batch, num_heads, num_splits, head_dim), torch.float32, query.device)
    else:
        m_part = l_part = acc_part = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        m_part,
        l_part,
        acc_part,
        scale * LOG2E,
        int(window or 0),
        float(softcap or 0.0) * LOG2E,  # scores are in base 2 in the kernel
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PREC=_dot_precision(query.dtype),
        UPCAST=_upcast_dots(query.dtype),
        num_warps=4,
        HAS_WINDOW=bool(window),
        HAS_SOFTCAP=bool(softcap),
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            m_part,
            l_part,
            acc_part,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


# -- prefill / chunked prefill / verify (variable-length queries) --------------------------------


@triton.jit
def _varlen_attention_kernel(
    Q,
    K,
    V,
    BT,
    CU_Q,
    CL,
    OUT,
    scale_log2,
    window,
    softcap,
    single_q_len,
    single_ctx,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr,
    PAGED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """PAGED: K/V are the caches, stride_k{b,s,h} = block, slot, head. Not PAGED: K/V are the
    chunk's own [T, Hk, D] rows, stride_kb = token stride, stride_ks unused."""
    qt = tl.program_id(0)
    r = tl.program_id(1)
    kvh = tl.program_id(2)
    if VARLEN:
        q_start = tl.load(CU_Q + r).to(tl.int32)
        q_len = tl.load(CU_Q + r + 1).to(tl.int32) - q_start
        if PAGED:
            ctx = tl.load(CL + r).to(tl.int32)
        else:
            ctx = q_len
    else:
        q_start = 0
        q_len = single_q_len
        ctx = single_ctx
    if qt * BLOCK_Q >= q_len:
        return
    prefix = ctx - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    rows = tl.arange(0, BLOCK_M)
    qi = qt * BLOCK_Q + rows // BLOCK_G
    g = rows % BLOCK_G
    row_mask = (qi < q_len) & (g < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    q_ptrs = Q + (tok * stride_qt + heads * stride_qh)[:, None] + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + qi

    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys up to the last query position of this tile (bottom-right causal).
    kv_end = tl.minimum(ctx, prefix + tl.minimum((qt + 1) * BLOCK_Q, q_len))
    kv_start = 0
    if HAS_WINDOW:  # the tile's first query sees nothing before its own position - window + 1
        kv_start = tl.maximum(prefix + qt * BLOCK_Q - window + 1, 0)
    table = BT + r.to(tl.int64) * stride_btb
    for n0 in range(kv_start, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        if PAGED:
            blk = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            off = (n % PAGE).to(tl.int64)
            k_base = blk * stride_kb + off * stride_ks + kvh * stride_kh
            v_base = blk * stride_vb + off * stride_vs + kvh * stride_vh
        else:
            key_tok = (q_start + n).to(tl.int64)
            k_base = key_tok * stride_kb + kvh * stride_kh
            v_base = key_tok * stride_vb + kvh * stride_vh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + k_base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        if HAS_SOFTCAP:  # in base 2: c * tanh(s / c) * log2(e) with c, s both times log2(e)
            scores = _softcap(scores, softcap)
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + v_base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = OUT + (tok * stride_ot + heads * stride_oh)[:, None] + d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _launch_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_tables: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    context_lens: torch.Tensor | None,
    num_requests: int,
    max_query_len: int,
    single_ctx: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    block_m: int | None,
    block_n: int | None,
) -> torch.Tensor:
    query = _last_contiguous(query)
    num_tokens, num_heads, head_dim = query.shape
    paged = block_tables is not None
    num_kv_heads = key.shape[-2]
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    group = num_heads // num_kv_heads
    out = _empty(query.shape, query.dtype, query.device)
    if num_tokens == 0 or num_requests == 0 or max_query_len == 0:
        return out
    block_g = triton.next_power_of_2(group)
    block_m = max(_tile(block_m or 64, "block_m"), block_g)
    block_q = block_m // block_g
    block_n = _tile(block_n or (64 if head_dim <= 64 else 32), "block_n")
    if paged:
        kv_strides = (key.stride(0), key.stride(1), key.stride(2))
        v_strides = (value.stride(0), value.stride(1), value.stride(2))
        page, bt_stride = key.shape[1], (block_tables.stride(0) if block_tables.dim() == 2 else 0)
    else:
        kv_strides = (key.stride(0), 0, key.stride(1))
        v_strides = (value.stride(0), 0, value.stride(1))
        page, bt_stride, block_tables = 1, 0, query  # unused
    varlen = cu_seqlens_q is not None
    dummy = query
    grid = (triton.cdiv(max_query_len, block_q), num_requests, num_kv_heads)
    _varlen_attention_kernel[grid](
        query,
        key,
        value,
        block_tables,
        cu_seqlens_q if varlen else dummy,
        context_lens if context_lens is not None else dummy,
        out,
        scale * LOG2E,
        int(window or 0),
        float(softcap or 0.0) * LOG2E,
        max_query_len,
        single_ctx,
        query.stride(0),
        query.stride(1),
        *kv_strides,
        *v_strides,
        bt_stride,
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        VARLEN=varlen,
        PAGED=paged,
        DOT_PREC=_dot_precision(query.dtype),
        UPCAST=_upcast_dots(query.dtype),
        HAS_WINDOW=bool(window),
        HAS_SOFTCAP=bool(softcap),
        num_warps=4,
    )
    return out


def paged_attention_varlen(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Several requests in one launch. query [T, Hq, D], request r owning rows
    [cu_seqlens_q[r], cu_seqlens_q[r + 1]); block_tables [R, max_blocks]; context_lens [R]
    include the request's queries (already stored), which sit at the last positions of its
    context. max_query_len (a host int, >= every query length) sizes the grid. Returns [T, Hq, D];
    rows not covered by cu_seqlens_q are left unwritten."""
    _check_cache(key_cache, value_cache)
    return _launch_varlen(
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        block_tables.shape[0],
        max_query_len,
        0,
        scale,
        window,
        softcap,
        block_m,
        block_n,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """One request's chunk of n query tokens at positions [context_len - n, context_len), same
    contract as the reference. query [n, Hq, D]; block_table [num_blocks]. Returns [n, Hq, D]."""
    _check_cache(key_cache, value_cache)
    return _launch_varlen(
        query,
        key_cache,
        value_cache,
        block_table,
        None,
        None,
        1,
        query.shape[0],
        int(context_len),
        scale,
        window,
        softcap,
        block_m,
        block_n,
    )


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Prefill with no cached prefix over the chunk's own K/V [n, Hk, D]."""
    key, value = _last_contiguous(key), _last_contiguous(value)
    return _launch_varlen(
        query,
        key,
        value,
        None,
        None,
        None,
        1,
        query.shape[0],
        query.shape[0],
        scale,
        window,
        softcap,
        block_m,
        block_n,
    )
