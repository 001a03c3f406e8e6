"""Fixtures for the speculative decoding tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

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
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every speculation test runs tiny models: one intra-op thread (tests/conftest.py)."""
