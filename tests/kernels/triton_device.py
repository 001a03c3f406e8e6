"""Where the triton kernel tests run: with CUDA present, the compiled kernels on the GPU
(benchmarks/gpu_check.py's kernels phase runs these tests there); elsewhere, CPU tensors under
the triton interpreter. `STOKER_KERNEL_TEST_DEVICE=cpu` (or `TRITON_INTERPRET=1`) keeps them on
the interpreter where a GPU is present too.

Import this before any `kernels` module: the interpreter is chosen when @triton.jit runs, i.e.
when the kernel modules are imported. Inputs are still drawn on CPU from CPU generators and then
moved, so every case sees the same values on either device.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch


def _pick() -> torch.device:
    choice = os.environ.get("STOKER_KERNEL_TEST_DEVICE", "auto")
    if choice == "auto":
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        choice = "cuda" if torch.cuda.is_available() and not interpret else "cpu"
    return torch.device(choice)


DEVICE = _pick()
ON_CUDA = DEVICE.type == "cuda"
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

cpu_only = pytest.mark.skipif(
    ON_CUDA, reason="runs triton on CPU tensors, which only the interpreter takes"
)


def tensor(data, **kwargs) -> torch.Tensor:
    return torch.tensor(data, device=DEVICE, **kwargs)


def reference_backend() -> contextlib.AbstractContextManager[None]:
    """What a test compares triton with through `dispatch`: on CPU its default (the references,
    or the native kernels where built), as before; on CUDA the default is triton itself, so the
    torch references are forced."""
    from stoker.kernels import dispatch

    return dispatch.force_backend("torch") if ON_CUDA else contextlib.nullcontext()
