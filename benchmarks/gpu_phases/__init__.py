"""The phases of benchmarks/gpu_check.py, one module each, in the order gpu_check.sh runs them.

Each module has `run(work, smoke, report) -> bool`: it measures into `report` (WORK/PHASE.json,
rewritten after every record) and says whether its checks passed. `shared` holds what several
phases share (the device, the timer, the engine, the workload).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_phases.shared import Report

PHASES = (
    "model", "kernels", "hf", "decode", "throughput", "timing", "serve", "paths", "profile"
)  # fmt: skip


def runner(phase: str) -> Callable[[Path, bool, Report], bool]:
    """The phase's `run`, its module imported only now (each phase runs in its own process)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
    return importlib.import_module(f"gpu_phases.{phase}").run
