"""A bounded exit for services asked to stop.

A process told to stop (SIGTERM) that then hangs on the way out, in a socket close or a stuck
thread, blocks a supervisor's restart and a compose stop. `stop_within` arms a deadline: past it,
every thread's Python stack goes to stderr (where the process hung) and the process exits 1.
"""

from __future__ import annotations

import faulthandler
import sys
import threading

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
