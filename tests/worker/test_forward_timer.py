"""ForwardTimer: host time on CPU, CUDA events on CUDA (skipped here without a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from stoker.services.worker.forward_timer import ForwardTimer


def test_cpu_device_time_is_the_host_time() -> None:
    timer = ForwardTimer(torch.device("cpu"))
    timer.start()
    timer.stop()
    assert timer.device_seconds(0.125) == 0.125


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_the_kernels_not_the_launches() -> None:
    timer = ForwardTimer(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    timer.start()
    for _ in range(20):
        x = x @ x / 64  # queued: the host returns long before the device is done
    timer.stop()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    device_s = timer.device_seconds(host_s)
    assert device_s > 0 and device_s != host_s
