"""Finding the tensor-parallel rank processes."""

from __future__ import annotations

from pathlib import Path

from tests.deploy.procs import children_of


def rank_processes(parent: int) -> list[int]:
    """The tensor-parallel ranks among parent's children."""
    out = []
    for pid in children_of(parent):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"stoker.services.worker.parallel.follower" in cmd:
            out.append(pid)
    return out
