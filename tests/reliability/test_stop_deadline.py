"""A service asked to stop always stops: past its deadline it prints where it hung and exits 1
(common/shutdown.py); and `kill -USR2` prints every thread's stack without stopping it
(common/logs.py). Real processes, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HANGS_ON_EXIT = """
import signal, sys, threading, time
from stoker.common.shutdown import exit_on_sigterm
signal.signal(signal.SIGTERM, exit_on_sigterm)
def wedged_cleanup():
    time.sleep(600)  # a close that never returns
threading.Thread(target=wedged_cleanup).start()  # not a daemon: exit waits for it
print("ready", flush=True)
time.sleep(600)
"""


def _start(code: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_hung_exit_is_cut_off_with_its_stacks() -> None:
    proc = _start(HANGS_ON_EXIT)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)  # the deadline is 10 s
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "Timeout" in err and "wedged_cleanup" in err


def test_usr2_prints_stacks_and_the_process_goes_on() -> None:
    proc = _start(
        "import time\n"
        "from stoker.common.logs import configure_logging\n"
        "configure_logging('test')\n"
        "def waiting_here():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
        "waiting_here()\n"
    )
    try:
        proc.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
        assert proc.poll() is None, "SIGUSR2 must not stop the process"
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "waiting_here" in err
