"""The CPU KV pool's memory (zeroed, resident from the start: MAP_POPULATE) and the huge-page
arena the packed weights live in."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from stoker.services.worker.cpu_tuning import (
    HUGE_PAGE,
    huge_page_arena,
    keep_freed_memory,
    release_freed_memory,
    resident_zeros,
)

MIB = 1024**2


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_resident_zeros_are_zero_and_writable():
    t = resident_zeros(3 * MIB + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * MIB + 5
    assert int(t.count_nonzero()) == 0
    view = t[: 4 * 1024].view(torch.float32)
    view.fill_(1.5)
    assert float(view.sum()) == 1.5 * 1024


def test_the_mapping_outlives_the_call():
    kept = resident_zeros(MIB).view(torch.float32)
    gc.collect()
    kept[-1] = 2.0  # would fault if the mapping had been closed
    assert float(kept.sum()) == 2.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_POPULATE is Linux's")
def test_pages_are_mapped_before_the_first_write():
    before = _rss_bytes()
    t = resident_zeros(256 * MIB)
    grown = _rss_bytes() - before
    # Lazily mapped memory would show next to no growth until written.
    assert grown >= 200 * MIB, grown
    del t


def test_huge_page_arena_is_aligned_zeroed_and_writable():
    arena = huge_page_arena(3 * HUGE_PAGE + 100)
    assert arena.numel() == 3 * HUGE_PAGE + 100
    assert arena.data_ptr() % HUGE_PAGE == 0
    assert int(arena.count_nonzero()) == 0
    arena[-1] = 7
    assert int(arena.sum()) == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_hands_freed_heap_memory_back():
    if not keep_freed_memory():
        pytest.skip("libc is not glibc")
    t = torch.ones(256 * MIB, dtype=torch.uint8)  # from the heap: the mmap threshold is 1 GiB
    del t
    before = _rss_bytes()
    assert release_freed_memory()
    assert before - _rss_bytes() >= 200 * MIB
