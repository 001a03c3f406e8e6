"""Step-telemetry accounting that needs no sockets."""

from __future__ import annotations

from stoker.common.telemetry import BusyTracker, IdleGapAccounting, StepTelemetry


def test_waits_that_began_with_no_work_are_not_idle_gaps():
    gaps = IdleGapAccounting()
    gaps.plan_sent(1)  # the first plan after start-up: the worker waited for requests
    gaps.plan_sent(2)  # planned while step 1 ran (overlap)
    assert gaps.gap(1, 3.0) == 0.0
    assert gaps.gap(2, 0.004) == 0.004  # the host was late: a real gap
    gaps.engine_idle()  # every request finished; the engine waits for new ones
    gaps.plan_sent(3)
    gaps.plan_sent(4)
    assert gaps.gap(3, 7.5) == 0.0
    assert gaps.gap(4, 0.001) == 0.001
    assert gaps.gap(3, 0.002) == 0.002  # each step id is excused once


def test_histograms_and_busy_fraction():
    t = StepTelemetry.empty()
    for v in (1e-6, 3e-5, 0.3, 99.0):
        t.observe("worker_idle", v)
    h = t.histograms["worker_idle"]
    assert sum(h.counts) == 4 and h.counts[0] == 1 and h.counts[-1] == 1
    assert abs(h.total - (1e-6 + 3e-5 + 0.3 + 99.0)) < 1e-9
    busy = BusyTracker(window_s=2.0)
    busy.add(0.5, now=10.0)
    busy.add(0.5, now=11.0)
    assert busy.fraction(now=11.5) == 0.5
    assert busy.fraction(now=12.6) == 0.25  # the first sample left the window
