"""The CPU KV pool's memory: zeroed, and resident from the start (mapped with MAP_POPULATE)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from services.worker.cpu_tuning import resident_zeros

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
