"""Fixtures for the speculative decoding tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tests.spec.spec_models import SpecModels, build


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], SpecModels]:
    """arch -> its target and drafts, built once per session on first use."""
    built: dict[str, SpecModels] = {}

    def get(arch: str) -> SpecModels:
        if arch not in built:
            built[arch] = build(tmp_path_factory.mktemp(f"spec-{arch}"), arch)
        return built[arch]

    return get


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """These models are tiny (hidden 64): intra-op threads cannot help them, and on a busy
    2-core machine every OpenMP barrier waits for a descheduled thread (measured: a 16x64 @
    64x512 linear went from 10 us to 15 ms). One thread keeps the run time predictable."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
