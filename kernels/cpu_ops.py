"""Native CPU kernels, compiled on first use with torch's C++ extension builder and cached.

They are optional: if the compiler or ninja is missing, or STOKER_CPU_KERNELS=0, the torch
references in this package run instead, and results are the same within float32 tolerance.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("stoker.kernels")
_SOURCES = Path(__file__).parent / "csrc"
_module: ModuleType | None | bool = None  # None: not tried; False: unavailable


def load() -> ModuleType | None:
    """The compiled module, or None when native kernels are disabled or cannot be built."""
    global _module
    if _module is None:
        _module = False
        if os.environ.get("STOKER_CPU_KERNELS", "1") != "0":
            try:
                from torch.utils.cpp_extension import load as build

                # Per environment, so two checkouts or venvs never rebuild over each other.
                build_dir = Path(sys.prefix) / "stoker-kernels" / f"torch-{torch.__version__}"
                build_dir.mkdir(parents=True, exist_ok=True)
                _module = build(
                    build_directory=str(build_dir),
                    name="stoker_cpu_kernels",
                    sources=[str(_SOURCES / "paged_decode_attention.cpp")],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as e:  # no compiler, no ninja, or a build error
                log.warning("native CPU kernels unavailable, using torch references: %s", e)
    return _module or None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Native decode attention when it applies (CPU, float32); None means use the reference."""
    if query.device.type != "cpu" or query.dtype != torch.float32:
        return None
    module = load()
    heads, kv_heads, head_dim = query.shape[1], key_cache.shape[2], query.shape[2]
    if module is None or heads % kv_heads or not module.supports(head_dim, heads // kv_heads):
        return None
    return module.paged_decode_attention(
        query, key_cache, value_cache, block_tables, context_lens, scale
    )
