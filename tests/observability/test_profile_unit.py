"""The profiler switch in one process: Profiler writes a loadable Chrome trace with the named
ranges, stops itself at num_steps, and `span` is a shared no-op while nothing records."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from stoker.common import profiling
from stoker.common.ipc import encoder, plan_decoder, scheduler_inbound_decoder
from stoker.common.messages import Abort, ProfileControl, SchedulerHello
from stoker.common.profiling import Profiler, span


def _names(path: Path) -> set[str]:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_span_is_a_shared_noop_when_idle() -> None:
    assert not profiling.profiling()
    assert span("forward") is span("sample")  # no object built, no torch call


def test_trace_has_named_ranges(tmp_path: Path) -> None:
    prof = Profiler(tmp_path / "traces", "worker")
    prof.start(record_shapes=True)
    assert prof.active and profiling.profiling()
    with span("forward"):
        torch.ones(8, 8) @ torch.ones(8, 8)
    with span("sample"):
        torch.ones(4).argmax()
    path = prof.stop()
    assert path is not None and path.parent == tmp_path / "traces"
    assert path.name.startswith("worker-")
    assert {"forward", "sample"} <= _names(path)
    assert not prof.active and not profiling.profiling()
    assert prof.stop() is None  # nothing recording: nothing written
    assert [p.name for p in (tmp_path / "traces").iterdir()] == [path.name]


def test_num_steps_stops_on_its_own(tmp_path: Path) -> None:
    prof = Profiler(tmp_path, "scheduler")
    prof.start(num_steps=3)
    for _ in range(2):
        with span("schedule"):
            pass
        prof.step()
    assert prof.active
    prof.step()
    assert not prof.active and prof.last_trace is not None
    assert "schedule" in _names(prof.last_trace)


def test_start_while_recording_and_without_dir(tmp_path: Path) -> None:
    off = Profiler(None, "worker")
    off.start()
    assert not off.enabled and not off.active
    prof = Profiler(tmp_path, "worker")
    prof.start(num_steps=5)
    prof.start(num_steps=1)  # ignored: the first start's options hold
    prof.step()
    assert prof.active
    prof.stop()


@pytest.mark.parametrize("decoder", [plan_decoder, scheduler_inbound_decoder])
def test_control_is_in_the_unions(decoder: msgspec.msgpack.Decoder) -> None:
    msg = ProfileControl("start", num_steps=4, record_shapes=True)
    assert decoder.decode(encoder.encode(msg)) == msg
    with pytest.raises(msgspec.DecodeError):  # malformed: the services log and drop it
        decoder.decode(encoder.encode(["profile", 3]))
    other = SchedulerHello("x") if decoder is plan_decoder else Abort(["r"])
    assert decoder.decode(encoder.encode(other)) == other
