"""A bounded exit for services asked to stop, and the stop of a supervisor's children.

A process told to stop (SIGTERM) that then hangs on the way out, in a socket close or a stuck
thread, blocks a supervisor's restart and a compose stop. `stop_within` arms a deadline: past it,
every thread's Python stack goes to stderr (where the process hung) and the process exits 1.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

import zmq

STOP_DEADLINE_S = 10.0  # under compose's default stop grace (10 s before SIGKILL) plus slack


def stop_within(seconds: float = STOP_DEADLINE_S) -> None:
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


def exit_on_sigterm(*_: object) -> None:
    """A plain SIGTERM handler: exit now (unwinding `finally` blocks), within the deadline."""
    stop_within()
    sys.exit(0)


def destroy_context_within(ctx: zmq.Context, linger_ms: int, seconds: float) -> bool:
    """`ctx.destroy(linger=linger_ms)`, waiting at most `seconds` for it; False if it did not
    finish. zmq_ctx_term has been seen to hang on a pipe to a peer that is stopped (a frozen
    worker, SIGSTOP in tests/reliability/test_faults.py) despite the linger, so a process that
    must exit with a meaningful code does not wait on it: the term is left to a daemon thread
    and the caller ends the process with os._exit."""
    term = threading.Thread(target=ctx.destroy, kwargs={"linger": linger_ms}, daemon=True)
    term.start()
    term.join(seconds)
    return not term.is_alive()


class StopSignals:
    """A supervisor's SIGINT / SIGTERM, while in the `with`: they set `requested`, which its
    loop polls. On leaving, both are ignored: the children are stopped by then, so a repeated
    signal has nothing left to do, and interpreter shutdown resets Python-level handlers to
    the default, so a signal landing then killed a finished launcher (exit -15 instead of 0)."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> StopSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *_: object) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True


def stop_processes(procs: Sequence[subprocess.Popen], wait_s: float) -> None:
    """SIGTERM every live process (and SIGCONT: a frozen one must run to stop), wait for them
    all up to one deadline, then kill the process group of any left (each child of a
    supervisor leads its own session)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
