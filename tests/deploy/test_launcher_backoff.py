"""A tokenizer that keeps dying backs off by deadline, not by sleeping in the launcher's loop
(which would delay a SIGTERM or an engine death by up to 30 s)."""

from __future__ import annotations

import os
import subprocess
import sys

from stoker.launcher import Child, _restart


def test_a_crash_looping_tokenizer_waits_out_its_backoff_without_blocking():
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    child = Child("tokenizer-0", cmd, dead, backoff_s=4.0, started=100.0)
    env = dict(os.environ)
    _restart(child, env, 0, now=101.0)  # died 1 s after its start: back off 4 s
    assert child.proc is dead and child.restarts == 0 and child.restart_at == 105.0
    _restart(child, env, 0, now=104.9)
    assert child.proc is dead  # still waiting; returned at once
    _restart(child, env, 0, now=105.0)
    try:
        assert child.proc is not dead and child.proc.poll() is None
        assert child.restarts == 1 and child.backoff_s == 8.0 and child.restart_at is None
    finally:
        child.proc.kill()
        child.proc.wait()


def test_a_tokenizer_that_ran_a_while_restarts_at_once():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = Child("tokenizer-0", cmd, dead, backoff_s=16.0, started=0.0)
    _restart(child, dict(os.environ), 0, now=100.0)  # ran 100 s: its backoff is forgiven
    try:
        assert child.proc is not dead and child.restarts == 1 and child.backoff_s == 1.0
    finally:
        child.proc.kill()
        child.proc.wait()
