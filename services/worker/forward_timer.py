"""Device time of a step's model forward.

On CUDA, kernels run asynchronously: host time around the forward measures kernel launches (or,
with a CUDA graph, one replay call), so a pair of events on the stream times the kernels
themselves. On CPU the forward is the host's own compute and the two times are the same.
"""

from __future__ import annotations

import torch


class ForwardTimer:
    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.on_cuda:
            self._start.record()

    def stop(self) -> None:
        if self.on_cuda:
            self._end.record()

    def device_seconds(self, host_s: float) -> float:
        """Call after the step has synchronised (sampling copies the tokens to the host), so the
        wait below costs nothing."""
        if not self.on_cuda:
            return host_s
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0
