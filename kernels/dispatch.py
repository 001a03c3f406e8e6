"""Kernel selection: triton on CUDA, the torch references everywhere else.

Every function here has the signature of its torch reference (`paged_attention.py`,
`rms_norm.py`, `rotary.py`) and picks, per call:
- the torch reference when `STOKER_FORCE_TORCH_KERNELS=1` is set (read at call time);
- triton when the deciding tensor is on CUDA, has a dtype the kernels take (float16, bfloat16,
  float32) and triton imports;
- on CPU in float32, the native C++ kernels (`cpu_ops.py`) where they apply and are built;
- the torch reference otherwise (CPU, or no triton installed). Triton is never used on CPU
  unless `force_backend("triton")` says so: tests do that under `TRITON_INTERPRET=1`, which must
  be set before triton is first imported.

Triton is imported lazily, on the first call that could use it, so CPU-only installs without
triton import this module (and the whole package) fine.

The attention functions take the per-layer `window` (sliding-window attention: a query at
position p sees keys in (p - window, p]) and `softcap` (Gemma 2's score soft-capping), None when
off, on every path.

Extra entry points with no reference twin: `paged_attention_varlen` (many prefill / verify /
decode requests in one launch), `apply_rotary_by_position` (cos/sin gathered in the kernel) and
`qk_norm_rotary` (q/k RMSNorm and rotary in one launch);
their torch fallbacks are built from the references. `race_sample` (the sampler's exponential
race with its noise fused) returns None where no kernel applies: its torch twin lives with the
noise, in services/worker/sampling_noise.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from stoker.kernels import activation as _ref_act
from stoker.kernels import cpu_ops
from stoker.kernels import paged_attention as _ref_attn
from stoker.kernels import rms_norm as _ref_norm
from stoker.kernels import rotary as _ref_rope

log = logging.getLogger("stoker.kernels")
FORCE_TORCH_ENV = "STOKER_FORCE_TORCH_KERNELS"
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_forced: str | None = None  # None: automatic; "triton" or "torch": forced


@functools.cache
def _triton_modules() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType] | None:
    try:
        from stoker.kernels import (
            triton_activation,
            triton_attention,
            triton_norm_rope,
            triton_sampling,
        )
    except ImportError as e:  # triton not installed (CPU-only install): references only
        log.info("triton kernels unavailable, using torch references: %s", e)
        return None
    return triton_attention, triton_norm_rope, triton_sampling, triton_activation


def triton_available() -> bool:
    """Whether triton and the triton kernel modules import (imports them on first call)."""
    return _triton_modules() is not None


@contextlib.contextmanager
def force_backend(backend: str | None) -> Iterator[None]:
    """Force "triton" or "torch" for every dispatched call in the block (None: automatic).
    Forcing triton raises if triton is not installed; it overrides STOKER_FORCE_TORCH_KERNELS
    and the device check, so CPU tensors go to triton (only workable under TRITON_INTERPRET=1)."""
    global _forced
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, not {backend!r}")
    if backend == "triton" and not triton_available():
        raise RuntimeError("triton is not installed")
    previous, _forced = _forced, backend
    try:
        yield
    finally:
        _forced = previous


def force_triton() -> contextlib.AbstractContextManager[None]:
    return force_backend("triton")


def _use_triton(x: torch.Tensor, *same_dtype: torch.Tensor) -> bool:
    if _forced is not None:
        return _forced == "triton"
    # Device first: on CPU this is the whole decision, so the hot path skips the environment.
    if not x.is_cuda or x.dtype not in _TRITON_DTYPES:
        return False
    if os.environ.get(FORCE_TORCH_ENV, "0") not in ("", "0"):
        return False
    if any(t.dtype != x.dtype for t in same_dtype):
        return False
    return triton_available()


def native_allowed() -> bool:
    """Native CPU kernels unless a backend is forced (tests comparing against the references);
    also asked by code that calls them itself (the native layer, models/llama.py)."""
    return _forced is None and os.environ.get(FORCE_TORCH_ENV, "0") in ("", "0")


def backend_for(x: torch.Tensor) -> str:
    """ "triton" or "torch": what a dispatched call deciding on `x` would run (for logs/tests)."""
    return "triton" if _use_triton(x) else "torch"


def _triton(index: int) -> ModuleType:
    """Module `index` of _triton_modules(); only called once _use_triton said yes."""
    modules = _triton_modules()
    assert modules is not None
    return modules[index]


def _attn() -> ModuleType:
    return _triton(0)


def _norm_rope() -> ModuleType:
    return _triton(1)


def _sampling() -> ModuleType:
    return _triton(2)


def _activation() -> ModuleType:
    return _triton(3)


# -- attention -----------------------------------------------------------------------------------


def store_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if _use_triton(key_cache):
        return _attn().store_kv(key_cache, value_cache, key, value, slot_mapping)
    if native_allowed() and cpu_ops.store_kv(key_cache, value_cache, key, value, slot_mapping):
        return None
    return _ref_attn.store_kv(key_cache, value_cache, key, value, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap)
    if _use_triton(query, key_cache, value_cache):
        return _attn().paged_decode_attention(*args)
    out = cpu_ops.paged_decode_attention(*args) if native_allowed() else None
    return out if out is not None else _ref_attn.paged_decode_attention(*args)


def decode_reads_cache_in_place(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether paged_decode_attention runs a kernel that reads the cache in place (triton, or
    the native CPU one) rather than the reference, which gathers each row's whole context. The
    step layout sends short chunks down the decode path only then: one row per position of a
    k + 1 verify would multiply the reference's gather by k + 1."""
    probe = torch.empty(0, dtype=dtype, device=device)
    if _use_triton(probe):
        return True
    return native_allowed() and cpu_ops.supports(dtype, device, num_heads, num_kv_heads, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    args = (query, key_cache, value_cache, block_table, context_len, scale, window, softcap)
    if _use_triton(query, key_cache, value_cache):
        return _attn().paged_prefill_attention(*args)
    return _ref_attn.paged_prefill_attention(*args)


def prefill_attention_batched(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    bounds: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Every prompt chunk of a step in one native CPU call (`cpu_ops.prefill_attention`); None
    where that does not apply, and the caller attends chunk by chunk."""
    if _use_triton(query, key_cache, value_cache) or not native_allowed():
        return None
    args = (query, key_cache, value_cache, block_tables, bounds, context_lens, scale)
    return cpu_ops.prefill_attention(*args, window, softcap)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    if _use_triton(query, key, value):
        return _attn().causal_attention(query, key, value, scale, window, softcap)
    return _ref_attn.causal_attention(query, key, value, scale, window, softcap)


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
) -> torch.Tensor:
    """Requests r = 0..R-1 in one call: query rows [cu_seqlens_q[r], cu_seqlens_q[r + 1]) are the
    last positions of a context of context_lens[r] tokens in block_tables[r] (bottom-right
    causal; already stored). Serves prefill chunks, speculative verify (k + 1 rows per request)
    and decode (1 row). max_query_len: a host int >= every request's query count."""
    if _use_triton(query, key_cache, value_cache):
        return _attn().paged_attention_varlen(
            query,
            key_cache,
            value_cache,
            block_tables,
            cu_seqlens_q,
            context_lens,
            max_query_len,
            scale,
            window,
            softcap,
        )
    out = torch.empty_like(query)
    bounds, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for r, context_len in enumerate(lens):
        rows = slice(bounds[r], bounds[r + 1])
        if rows.stop > rows.start:
            out[rows] = _ref_attn.paged_prefill_attention(
                query[rows],
                key_cache,
                value_cache,
                block_tables[r],
                context_len,
                scale,
                window,
                softcap,
            )
    return out


# -- norms and rotary ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        return _norm_rope().rms_norm(x, weight, eps)
    out = cpu_ops.rms_norm(x, weight, eps) if native_allowed() else None
    return out if out is not None else _ref_norm.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        return _norm_rope().add_rms_norm(x, residual, weight, eps)
    out = cpu_ops.add_rms_norm(x, residual, weight, eps) if native_allowed() else None
    return out if out is not None else _ref_norm.add_rms_norm(x, residual, weight, eps)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(q, k):
        return _norm_rope().apply_rotary(q, k, cos, sin)
    out = cpu_ops.apply_rotary(q, k, cos, sin) if native_allowed() else None
    return out if out is not None else _ref_rope.apply_rotary(q, k, cos, sin)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary(rms_norm(q, q_weight), rms_norm(k, k_weight), cos, sin): one triton launch
    where the weights share q's dtype, three calls elsewhere."""
    if _use_triton(q, k, q_weight, k_weight):
        return _norm_rope().qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin)
    return apply_rotary(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)


def apply_rotary_by_position(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary(q, k, cos_table[positions], sin_table[positions]); triton gathers the rows
    in the kernel from the float32 tables, the fallback casts them to q's dtype as the model
    does today."""
    if _use_triton(q, k):
        return _norm_rope().apply_rotary_by_position(q, k, cos_table, sin_table, positions)
    cos = cos_table[positions].to(q.dtype)
    sin = sin_table[positions].to(q.dtype)
    return apply_rotary(q, k, cos, sin)


# -- activation ----------------------------------------------------------------------------------


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * inter]: one triton pass on CUDA."""
    if _use_triton(gate_up):
        return _activation().silu_and_mul(gate_up)
    out = cpu_ops.silu_and_mul(gate_up) if native_allowed() else None
    return out if out is not None else _ref_act.silu_and_mul(gate_up)


# -- sampling ------------------------------------------------------------------------------------


def race_sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """argmax(probs / noise) per row with the counter-based noise of int64 `keys` computed in
    the kernel (triton_sampling.py), where triton runs (float32 probs); None elsewhere, where
    the caller materialises the noise (services/worker/sampling_noise.py) and races on it."""
    if probs.dtype == torch.float32 and _use_triton(probs):
        return _sampling().race_sample(probs, keys)
    return None
