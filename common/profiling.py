"""The profiler switch (`stoker serve --profile-dir DIR`, docs/observability.md#profiling).

The worker and the scheduler each hold one Profiler. `POST /start_profile` reaches both as a
ProfileControl; each then runs `torch.profiler.profile` until `POST /stop_profile` or until it
has run `num_steps` steps, and writes one Chrome trace (Perfetto opens it) into DIR.

`span(name)` marks a named range in the trace. With no profiler running it returns a shared
null context after one global check, so the hot paths pay nothing and torch is never imported
by processes (the scheduler) that do not profile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.common.messages import ProfileControl

log = logging.getLogger("stoker.profiling")

_NULL = contextlib.nullcontext()
_active = False  # any Profiler in this process is recording


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named range in the trace while profiling; a no-op (one global read) otherwise."""
    if not _active:
        return _NULL
    from torch.profiler import record_function

    return record_function(name)


def profiling() -> bool:
    return _active


class Profiler:
    def __init__(self, out_dir: str | os.PathLike[str] | None, process: str) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        self.process = process
        self._prof: Any = None
        self._steps_left = 0  # 0: until stopped
        self.last_trace: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.out_dir is not None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, num_steps: int = 0, record_shapes: bool = False, with_stack: bool = False):
        """Start recording; a start while recording is ignored (the first one's options hold)."""
        global _active
        if self.out_dir is None:
            log.warning("%s: profile start ignored: no --profile-dir", self.process)
            return
        if self._prof is not None:
            log.info("%s: already profiling", self.process)
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack)
        prof.start()
        self._prof, self._steps_left = prof, max(0, num_steps)
        _active = True
        log.warning("%s: profiling (%s steps)", self.process, num_steps or "until stopped")

    def step(self) -> None:
        """One step ran; stops and writes the trace at num_steps. Call only when active."""
        if self._steps_left:
            self._steps_left -= 1
            if not self._steps_left:
                self.stop()

    def stop(self) -> Path | None:
        """Stop and write the trace; the path written, or None when nothing was recording."""
        global _active
        prof, self._prof = self._prof, None
        _active = False
        if prof is None or self.out_dir is None:
            return None
        prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.out_dir / f"{self.process}-{os.getpid()}-{stamp}-{time.time_ns() % 10**9}.json"
        tmp = path.with_suffix(".json.tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.rename(path)  # whole or absent: a reader polling DIR never sees half a file
        self.last_trace = path
        log.warning("%s: profile written to %s", self.process, path)
        return path


def control(profiler: Profiler, msg: ProfileControl) -> bool:
    """Apply a ProfileControl (start or stop); False for an unknown action, which is dropped.
    A start or stop that fails is logged: a failed trace must not take the process down."""
    try:
        if msg.action == "start":
            profiler.start(msg.num_steps, msg.record_shapes, msg.with_stack)
        elif msg.action == "stop":
            profiler.stop()
        else:
            log.warning("%s: dropped a profile action %r", profiler.process, msg.action)
            return False
    except Exception:
        log.exception("%s: profile %s failed", profiler.process, msg.action)
    return True
