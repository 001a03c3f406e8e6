"""Native CPU kernels, compiled on first use with torch's C++ extension builder and cached.

They are optional: if the compiler or ninja is missing, or STOKER_CPU_KERNELS=0, the torch
references in this package run instead, and results are the same within float32 tolerance.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("stoker.kernels")
_SOURCES = Path(__file__).parent / "csrc"
_module: ModuleType | None | bool = None  # None: not tried; False: unavailable


def _cpu_signature() -> str:
    """A short hash of what -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keys = ("model name", "flags", "Features", "CPU part")
        text = "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keys}))
    except OSError:
        text = platform.processor() or platform.machine()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


# 512-bit vectors for the loops GCC vectorises itself (norms, rotary): -march=native on an
# AVX-512 CPU otherwise prefers 256-bit ones, and the bfloat16 norm and rotary ran 1.4-1.5x
# slower for it (docs/benchmarks.md, CPU kernels). CPUs without AVX-512 ignore it.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]


def _source_hash() -> str:
    digest = hashlib.sha1(" ".join(CFLAGS).encode())
    for path in sorted([*_SOURCES.glob("*.cpp"), *_SOURCES.glob("*.h")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def load() -> ModuleType | None:
    """The compiled module, or None when native kernels are disabled or cannot be built."""
    global _module
    if _module is None:
        _module = False
        if os.environ.get("STOKER_CPU_KERNELS", "1") != "0":
            try:
                from torch.utils.cpp_extension import load as build

                # Per environment, per CPU (-march=native code from one machine can die with
                # SIGILL on another) and per source version: checkouts at different commits
                # sharing one venv would otherwise rebuild over each other, and a build killed
                # mid-way leaves a lock every later process waits on.
                build_dir = (
                    Path(sys.prefix)
                    / "stoker-kernels"
                    / f"torch-{torch.__version__}-cpu-{_cpu_signature()}-src-{_source_hash()}"
                )
                build_dir.mkdir(parents=True, exist_ok=True)
                _module = build(
                    build_directory=str(build_dir),
                    name="stoker_cpu_kernels",
                    sources=[
                        str(_SOURCES / name)
                        for name in (
                            "bindings.cpp",
                            "greedy_screen.cpp",
                            "store_kv.cpp",
                            "silu_mul.cpp",
                            "paged_decode_attention.cpp",
                            "prefill_attention.cpp",
                            "norm_rope.cpp",
                            "panel_linear.cpp",
                            "sampling_noise.cpp",
                            "llama_layer.cpp",
                            "bf16_pairs.cpp",
                            "token_mask.cpp",
                        )
                    ],
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as e:  # no compiler, no ninja, or a build error
                log.warning("native CPU kernels unavailable, using torch references: %s", e)
    return _module or None


# What the native kernels take (attention: the KV cache's dtype); they compute in float32.
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def supports(
    dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the native decode attention takes this model's attention shape and dtype."""
    if device.type != "cpu" or dtype not in NATIVE_DTYPES or num_heads % num_kv_heads:
        return False
    module = load()
    return module is not None and module.supports(head_dim, num_heads // num_kv_heads)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Native decode attention when it applies (CPU, float32 or bfloat16, query and cache alike);
    None means use the reference.
    window / softcap: None (or 0) is off."""
    heads, kv_heads, head_dim = query.shape[1], key_cache.shape[2], query.shape[2]
    if key_cache.dtype != query.dtype or not supports(
        query.dtype, query.device, heads, kv_heads, head_dim
    ):
        return None
    args = (query, key_cache, value_cache, block_tables, context_lens, scale)
    return load().paged_decode_attention(*args, window or 0, softcap or 0.0)  # type: ignore[union-attr]


def prefill_attention(
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
    """Native attention of a step's prompt chunks (CPU, float32 or bfloat16), None where it does
    not apply. query [T, Hq, D]: chunk s is rows [bounds[s], bounds[s + 1]), its last row at
    position context_lens[s] - 1, its K/V already stored in the cache through block_tables[s]."""
    if (
        query.device.type != "cpu"
        or query.dtype not in NATIVE_DTYPES
        or key_cache.dtype != query.dtype
        or query.shape[1] % key_cache.shape[2]
    ):
        return None
    module = load()
    if module is None or not module.prefill_supports(query.shape[2]):
        return None
    args = (query, key_cache, value_cache, block_tables, bounds, context_lens, scale)
    return module.prefill_attention(*args, window or 0, softcap or 0.0)


def use_bf16_pairs() -> bool:
    """Whether bfloat16 linear weights go in `bf16_pairs_linear`'s layout instead of oneDNN's:
    by default where it was built (AVX512-BF16); STOKER_CPU_GEMM=onednn forces oneDNN. On the
    Zen 4 box it ran SmolLM2's bfloat16 layers 2.2-4.8x faster than oneDNN at one row, 1.2-1.6x
    at 16 and level from 256 up (docs/benchmarks.md, CPU kernels)."""
    if os.environ.get("STOKER_CPU_GEMM", "auto") == "onednn":
        return False
    module = load()
    return module is not None and bool(module.bf16_pairs_supported())


def use_panel_linear() -> bool:
    """Whether float32 linear weights go in `panel_linear`'s layout instead of oneDNN's.

    STOKER_CPU_GEMM=panel / onednn forces the choice; by default panels on CPUs whose best ISA
    is AVX2 or AVX-512. On the AVX2 box the panel kernel ran SmolLM2's linear layers 1.4-2.0x
    faster than oneDNN's packed kernel at 1-8 rows and 1.06-1.3x at 32-512; on the AVX-512 Zen 4
    box 1.8-2.3x at 1-8 rows, 1.3x at 32 and level from 64 up (docs/benchmarks.md, CPU
    kernels)."""
    choice = os.environ.get("STOKER_CPU_GEMM", "auto")
    if choice == "onednn":
        return False
    module = load()
    if module is None or not module.panel_linear_supported():
        return False
    return choice == "panel" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [N, K] weight (N a multiple of 16) as [N / 16, K, 16] panels."""
    return load().pack_panels(weight.detach().contiguous())  # type: ignore[union-attr]


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W^T (+ bias) against `pack_panels(W)`."""
    return load().panel_linear(x, panels, bias)  # type: ignore[union-attr]


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight (N a multiple of 16, K even) as bfloat16 [N / 16, K / 2, 16, 2]."""
    return load().pack_bf16_pairs(weight.detach())  # type: ignore[union-attr]


def bf16_pairs_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """bfloat16 x @ W^T (+ bias), rounded to bfloat16 once, against `pack_bf16_pairs(W)`."""
    return load().bf16_pairs_linear(x, packed, bias)  # type: ignore[union-attr]


def _native_rows(*tensors: torch.Tensor) -> ModuleType | None:
    """The module when every tensor is a CPU one of one dtype, float32 or bfloat16, and the
    native build exists."""
    dtype = tensors[0].dtype
    if dtype not in NATIVE_DTYPES:
        return None
    for t in tensors:  # a plain loop: ~150 calls a decode step, and any() costs a generator
        if not t.is_cpu or t.dtype != dtype:
            return None
    return load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    module = _native_rows(x, weight)
    if module is None or x.dim() != 2 or x.stride(1) != 1:
        return None
    return module.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    module = _native_rows(x, residual, weight)
    if module is None or x.dim() != 2 or x.stride(1) != 1 or residual.stride(-1) != 1:
        return None
    return module.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up natively (float32 rows); None: use the reference."""
    if gate_up.dtype != torch.float32 or not gate_up.is_cpu or gate_up.dim() != 2:
        return None
    if gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        return None
    module = load()
    return None if module is None else module.silu_and_mul(gate_up)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, fill: float
) -> bool:
    """The grammar mask natively, in place (kernels/token_mask.py); False: use the reference."""
    if logits.dtype not in NATIVE_DTYPES or not logits.is_cpu or logits.stride(-1) != 1:
        return False
    module = load()
    if module is None:
        return False
    module.apply_token_bitmask(logits, bitmask, rows.contiguous(), fill)
    return True


def store_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Write the rows natively; False: the caller uses the reference (index_copy_)."""
    module = _native_rows(key_cache, value_cache, key, value)
    if module is None or key.dim() != 3 or slot_mapping.dtype != torch.int64:
        return False
    if not slot_mapping.is_cpu or not key_cache.is_contiguous():
        return False
    for t in (key, value):  # rows of [kv_heads, head_dim] each contiguous (views into qkv are)
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return False
    module.store_kv(key_cache, value_cache, key, value, slot_mapping)
    return True


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """New rotated (q, k), read from views into the qkv projection; None: use the reference."""
    module = _native_rows(q, k, cos, sin)
    if module is None or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    return module.apply_rotary(q, k, cos, sin)
