"""A small random-init model for the reliability tests, and the fuzz server on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factory import make_model
from tests.reliability.serve import Served


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("reliability") / "tiny", "llama")


@pytest.fixture(scope="module")
def fuzz_server(model, tmp_path_factory):
    """The null model (no compute per token) and short contexts, so a fuzzed request that is
    valid costs little however large the numbers it picked."""
    tmp = tmp_path_factory.mktemp("fuzz")
    flags = ["--null-model", "--max-model-len", "64", "--num-kv-blocks", "64", "--max-n", "4"]
    server = Served(model, tmp / "run", tmp / "serve.log", *flags)
    yield server
    server.stop()
