"""kernels: the triton kernel tests themselves (tests/kernels, which run compiled on CUDA where a
GPU is present: tests/kernels/triton_device.py), in this process through pytest, one record per
test and kernel it checks.

On the GPU the slow sweeps run too (every GQA 1/4/8 x head dim 64/128 x block size 16/32, long
contexts and prefixes), after the default set, so a phase cut short by its timeout still holds
the default set's records; the sm_90 compile-only tests are left out (compiling for real is what
the phase does). `GPU_CHECK_KERNELS=rotary,race` runs only the tests of those kernels.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpu_phases.shared import Report, cuda

REPO = Path(__file__).resolve().parents[2]
TEST_FILES = ("tests/kernels/test_triton_kernels.py", "tests/kernels/test_window_softcap_triton.py")
# Test-name prefix -> the kernels its assertions check; the first match wins. The labels are
# the records' `kernel` and what GPU_CHECK_KERNELS selects by.
KERNELS_BY_TEST = (
    ("test_store_kv", ("store_kv",)),
    ("test_decode_split_k", ("decode_split",)),
    ("test_decode", ("decode",)),
    ("test_prefill", ("prefill_paged",)),
    ("test_varlen_and_causal", ("varlen", "causal")),
    ("test_varlen", ("varlen",)),
    ("test_causal", ("causal",)),
    ("test_rms_norm", ("rms_norm",)),
    ("test_add_rms_norm", ("add_rms_norm",)),
    ("test_rotary_matches", ("rotary", "rotary_by_position")),
    ("test_rotary", ("rotary",)),
    ("test_qk_norm_rotary", ("qk_norm_rotary",)),
    ("test_silu_and_mul", ("silu_and_mul",)),
    ("test_race", ("race",)),
    ("test_sampler_race", ("race",)),
    ("test_dispatch", ("dispatch",)),
    ("test_package", ("dispatch",)),
    ("test_tiny_model", ("model",)),
    ("test_kernels_compile", ("compile",)),
    ("test_window_and_softcap_kernels_compile", ("compile",)),
)
SHAPE_PARAMS = ("dtype", "group", "head_dim", "block_size")
GREATEST_ERROR = re.compile(r"Greatest absolute difference: (\S+)")


def kernels_of(item) -> tuple[str, ...]:
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    params = getattr(getattr(item, "callspec", None), "params", {})
    for prefix, kernels in KERNELS_BY_TEST:
        if name.startswith(prefix):
            if kernels == ("rms_norm",) and len(params.get("shape", ())) == 3:
                return ("qk_rms_norm",)  # per-head rows, as q/k norms run
            return kernels
    return (name.removeprefix("test_"),)


def _greatest_error(text: str) -> float | None:
    """The max abs error torch.testing.assert_close reports, where a failure came from one."""
    found = GREATEST_ERROR.search(text)
    try:
        return float(found.group(1).rstrip(",")) if found else None
    except ValueError:
        return None


class Recorder:
    """A pytest plugin: picks and orders the tests, and writes a record per test and kernel as
    each test finishes."""

    def __init__(self, report: Report, only: set[str], sweeps: bool) -> None:
        self.report, self.only, self.sweeps = report, only, sweeps
        self.meta: dict[str, tuple[tuple[str, ...], dict]] = {}
        self.state: dict[str, dict] = {}
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}

    def pytest_collection_modifyitems(self, config, items) -> None:
        keep, drop = [], []
        for item in items:
            (keep if self._wanted(kernels_of(item)) else drop).append(item)
        keep.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep
        for item in keep:
            params = getattr(getattr(item, "callspec", None), "params", {})
            self.meta[item.nodeid] = (kernels_of(item), params)

    def _wanted(self, kernels: tuple[str, ...]) -> bool:
        if self.only and not self.only & set(kernels):
            return False
        return not (self.sweeps and "compile" in kernels)  # the sm_90 builds on the CPU

    def pytest_runtest_logreport(self, report) -> None:
        state = self.state.setdefault(report.nodeid, {"s": 0.0, "outcome": "passed"})
        state["s"] += report.duration
        if report.failed:
            state["outcome"] = "failed"
            text = report.longreprtext
            state.setdefault("error", text.strip().splitlines()[-1][:300] if text else report.when)
            state.setdefault("max_abs_err", _greatest_error(text))
        elif report.skipped and state["outcome"] == "passed":
            state["outcome"] = "skipped"
        if report.when == "teardown":
            self._record(report.nodeid, self.state.pop(report.nodeid))

    def _record(self, nodeid: str, state: dict) -> None:
        kernels, params = self.meta.get(nodeid, (("unknown",), {}))
        shape = {k: params.get(k) for k in SHAPE_PARAMS}  # None: not a parameter of the test
        if shape["dtype"] is not None:
            shape["dtype"] = str(shape["dtype"])
        self.counts[state["outcome"]] += 1
        for kernel in kernels:
            self.report.add(
                kernel=kernel,
                test=nodeid,
                **shape,
                max_abs_err=state.get("max_abs_err"),
                outcome=state["outcome"],
                ok=state["outcome"] != "failed",
                s=round(state["s"], 2),
                **({"error": state["error"]} if "error" in state else {}),
            )
        print(f"kernels: {nodeid}: {state['outcome']}")


def run(work: Path, smoke: bool, report: Report) -> bool:
    import pytest

    if not cuda() and os.environ.get("TRITON_INTERPRET") != "1":
        report.set(skipped="no CUDA and TRITON_INTERPRET is not 1")
        return True
    only = {k for k in os.environ.get("GPU_CHECK_KERNELS", "").split(",") if k}
    sweeps = cuda() and not smoke
    recorder = Recorder(report, only, sweeps)
    args = [
        *(str(REPO / f) for f in TEST_FILES),
        f"--rootdir={REPO}",
        "-c", str(REPO / "pyproject.toml"),
        "-m", "slow or not slow" if sweeps else "not slow",
        "-q", "-rfE", "--tb=short",
    ]  # fmt: skip
    report.set(pytest_args=args[len(TEST_FILES) :])
    code = int(pytest.main(args, plugins=[recorder]))
    report.set(pytest_exit=code, **recorder.counts)
    return code == 0 and recorder.counts["passed"] > 0
