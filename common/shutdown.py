"""A bounded exit for services asked to stop.

A process told to stop (SIGTERM) that then hangs on the way out, in a socket close or a stuck
thread, blocks a supervisor's restart and a compose stop. `stop_within` arms a deadline: past it,
every thread's Python stack goes to stderr (where the process hung) and the process exits 1.
"""

from __future__ import annotations

import faulthandler
import sys

STOP_DEADLINE_S = 10.0  # under compose's default stop grace (10 s before SIGKILL) plus slack


def stop_within(seconds: float = STOP_DEADLINE_S) -> None:
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


def exit_on_sigterm(*_: object) -> None:
    """A plain SIGTERM handler: exit now (unwinding `finally` blocks), within the deadline."""
    stop_within()
    sys.exit(0)
