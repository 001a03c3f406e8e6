import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """For tiny models (hidden 64): intra-op threads cannot help them, and on a busy 2-core
    machine every OpenMP barrier waits for a descheduled thread (measured: a 16x64 @ 64x512
    linear went from 10 us to 15 ms). One thread keeps the run time predictable. Modules opt in
    with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
