"""Process-level settings that make torch fast on CPU.

glibc returns large freed blocks to the OS (mmap'd allocations above a threshold, and heap
trimming), so every step re-faults tens of MB of fresh zeroed pages for its temporaries. On a
12-layer prefill that made steps 3-10x slower and erratic. Keeping freed memory in the process
(as tcmalloc/jemalloc would) removes it. Measured: docs/kv-cache.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger("stoker.worker")

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3


def _glibc(function: str) -> Callable[..., int] | None:
    """A function of the process's C library, or None where it has none (libc is not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds. Returns False where libc is not glibc."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    # mallopt takes a C int: 1 GiB thresholds, the largest round values that fit.
    ok = bool(mallopt(M_MMAP_THRESHOLD, 1 << 30) or mallopt(M_MMAP_THRESHOLD, 32 << 20))
    ok &= bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
    ok &= bool(mallopt(M_TOP_PAD, 256 << 20))
    if not ok:
        log.info("could not tune malloc; CPU steps may be slower")
    return ok


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the OS once (malloc_trim), after start-up: loading
    frees the checkpoint's tensors as it packs them, and with `keep_freed_memory`'s thresholds
    that memory would stay resident for the life of the process (about 440 MB for the
    benchmark Llama). Returns False where libc is not glibc."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def resident_zeros(nbytes: int) -> torch.Tensor:
    """`nbytes` zeroed bytes, all mapped now rather than on first touch.

    The KV pool is written a block at a time as requests arrive. Lazily mapped, each new 4 KiB
    page then costs a page fault inside a step: on this project's VM box first touches ran at 5 s
    per GiB, which was 2 % of an offline run, all in store_kv (docs/kv-cache.md). MAP_POPULATE
    maps the pool at start-up in one call (0.3 s per GiB there), as vLLM's torch.zeros does by
    writing it. The pool's memory is resident from then on, which is
    what --kv-cache-memory-gb reserves."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    try:
        region = mmap.mmap(-1, max(1, nbytes), flags=flags)
    except OSError:
        return torch.zeros(nbytes, dtype=torch.uint8)
    # The numpy view keeps the mapping alive for as long as the tensor lives.
    return torch.from_numpy(np.frombuffer(region, dtype=np.uint8, count=nbytes))


HUGE_PAGE = 2 << 20


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` of unmapped memory, 2 MiB-aligned and advised for transparent huge pages
    (MADV_HUGEPAGE: the kernel backs it with 2 MiB pages where THP is `always` or `madvise`).

    For the weights every step streams: with 4 KiB pages each page of a streamed panel costs a
    TLB miss and stops the hardware prefetcher at its boundary. Against the same panels on 4 KiB
    pages, SmolLM2's linear layers ran 11-13 % faster at 1-8 rows and 1-3 % at 64
    (docs/benchmarks.md, CPU kernels). Pages are mapped when first written."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP compiled out: 4 KiB pages, as before
            region.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(region, dtype=np.uint8)
    offset = -buf.ctypes.data % HUGE_PAGE
    return torch.from_numpy(buf[offset : offset + nbytes])
