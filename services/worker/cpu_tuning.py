"""Process-level settings that make torch fast on CPU.

glibc returns large freed blocks to the OS (mmap'd allocations above a threshold, and heap
trimming), so every step re-faults tens of MB of fresh zeroed pages for its temporaries. On a
12-layer prefill that made steps 3-10x slower and erratic. Keeping freed memory in the process
(as tcmalloc/jemalloc would) removes it. Measured in docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("stoker.worker")

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds. Returns False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # mallopt takes a C int: 1 GiB thresholds, the largest round values that fit.
    ok = bool(mallopt(M_MMAP_THRESHOLD, 1 << 30) or mallopt(M_MMAP_THRESHOLD, 32 << 20))
    ok &= bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
    ok &= bool(mallopt(M_TOP_PAD, 256 << 20))
    if not ok:
        log.info("could not tune malloc; CPU steps may be slower")
    return ok
