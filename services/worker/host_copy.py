"""Small host <-> device transfers that do not stall the host on the step in flight.

A `torch.tensor(list, device="cuda")` copies from pageable memory, which waits for everything
queued on the stream before it, so a sampling-batch tensor built after the forward's launch
made the host wait out the whole forward there (docs/overlap.md, the H200 host profile: 258
such calls held 0.46 of a 1.39 s workload slice). Pinned memory with non_blocking queues the
copy behind the forward instead, and the one wait a step needs, for the sampled ids, happens in
a stream synchronize, which releases the GIL (the in-process engine plans the next step
meanwhile).
On CPU both are the plain calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_list(t: torch.Tensor) -> list:
    """t.tolist(), waiting for the device with the GIL released."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
    return t.tolist()
