"""The GPU checks of issue 7, one phase per process (benchmarks/gpu_check.sh runs them in order,
each under a hard timeout, then merges). Each phase is a module of benchmarks/gpu_phases/:

    model       build the Qwen3-0.6B-shaped random-init folder (bf16) with a tokenizer
    kernels     the triton kernel tests (tests/kernels) on the device, through pytest: every
                kernel against its torch reference, bf16 and fp32, GQA 1/4/8, head dim 64/128,
                block size 16/32
    hf          greedy agreement with HF transformers in bf16, tolerance-based on logits
    decode      batch-1 decode ms/token with and without CUDA graphs
    throughput  the nano-vllm workload: 256 requests, input/output lengths uniform 100-1024
    timing      decode attention, RMSNorm, rotary, silu-and-mul and the sampling race against
                the bandwidth floor
    serve       `stoker serve --device cuda` (real processes, ZMQ, HTTP): one completion, then
                `stoker bench serve` at 128 streams, and no KV block leaked at idle
    paths       n-gram speculation, prefix caching and preemption against plain greedy (fp32)
    profile     torch.profiler's top kernels (batch-1 decode, a workload slice) and cProfile of
                eager batch-1 forwards, into WORK/profile_*.txt

    python benchmarks/gpu_check.py PHASE [--work DIR] [--smoke]
    python benchmarks/gpu_check.py --phase decode,throughput [--work DIR] [--smoke] [--out FILE]
    python benchmarks/gpu_check.py merge [--work DIR] [--out FILE]

Each phase writes DIR/PHASE.json as it goes, so a phase killed by its timeout still leaves what
it measured. `--phase` runs the phases named, in the order given, each in its own process (no
timeout: gpu_check.sh adds those), then merges. `--smoke` runs every phase at tiny shapes on CPU
(tests/bench/test_gpu_check.py); the kernels phase then needs TRITON_INTERPRET=1, and CUDA
graphs run in their eager-replay mode. `--kernels rotary,race` (or GPU_CHECK_KERNELS) limits the
kernels phase to those kernels' tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # imported rather than run: gpu_phases and serving live here
    sys.path.append(str(HERE))
if str(REPO) not in sys.path:  # tests.* (the model factory, the kernel tests), after
    sys.path.append(str(REPO))  # site-packages: docs/architecture.md, "Package layout"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from gpu_phases import PHASES, runner  # noqa: E402

DEFAULT_WORK = Path("/tmp/stoker-gpu-check")


def merge(work: Path, out: Path) -> int:
    """Every phase's JSON and exit status in one file; exit 0 only if every phase that ran
    passed (one not asked for is listed as not-run and does not count)."""
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}
    all_ok, ran = True, 0
    for phase in PHASES:
        path, rc_path = work / f"{phase}.json", work / f"{phase}.rc"
        data = json.loads(path.read_text()) if path.is_file() else {"ok": None}
        status = rc_path.read_text().split() if rc_path.is_file() else ["not-run", "0"]
        data["exit"], data["wall_s"] = status[0], float(status[1])
        if status[0] == "124":
            data["timed_out"] = True
        if status[0] != "not-run":
            ran += 1
            all_ok = all_ok and data.get("ok") is True
        summary["phases"][phase] = data
    summary["ok"] = all_ok and ran > 0
    out.write_text(json.dumps(summary, indent=1, default=str))
    for phase, data in summary["phases"].items():
        print(f"{phase:11s} ok={data.get('ok')} exit={data['exit']} wall={data['wall_s']:.0f}s")
    return 0 if summary["ok"] else 1


def run_phase(phase: str, work: Path, smoke: bool) -> int:
    """One phase in this process: its report, its checks, exit 0 if they passed."""
    import torch
    from gpu_phases.shared import Report, cuda

    if not cuda() and not smoke:
        print("gpu_check: no CUDA device; use --smoke for the CPU check", file=sys.stderr)
        return 2
    if not cuda():
        torch.set_num_threads(1)  # tiny shapes: threads only add barrier waits on a busy box
    report = Report(work / f"{phase}.json", phase, smoke)
    try:
        ok = runner(phase)(work, smoke, report)
    except Exception as e:
        traceback.print_exc()
        report.set(error=f"{type(e).__name__}: {e}")
        ok = False
    report.set(ok=ok)
    return 0 if ok else 1


def run_phases(phases: list[str], work: Path, smoke: bool, out: Path) -> int:
    """Each phase in its own process (a crash or a held GPU allocation stays in it), its exit
    status and wall time into WORK/PHASE.rc as gpu_check.sh writes them, then the merge."""
    for name in PHASES:
        for stale in (work / f"{name}.json", work / f"{name}.rc"):
            stale.unlink(missing_ok=True)
    for phase in phases:
        started = time.perf_counter()
        command = [sys.executable, __file__, phase, "--work", str(work)]
        rc = subprocess.run(command + (["--smoke"] if smoke else []), check=False).returncode
        seconds = time.perf_counter() - started
        (work / f"{phase}.rc").write_text(f"{rc} {seconds:.0f}\n")
        print(f"== {phase}: exit {rc} after {seconds:.0f}s", flush=True)
    return merge(work, out)


def _phase_list(text: str) -> list[str]:
    phases = [p for p in text.replace(",", " ").split() if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise argparse.ArgumentTypeError(f"phases are {', '.join(PHASES)}; not {unknown or text!r}")
    return phases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("phase", nargs="?", choices=[*PHASES, "merge"], help="one phase, or merge")
    ap.add_argument("--phase", dest="phases", type=_phase_list, help="several: decode,profile")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="model folder and JSON")
    ap.add_argument("--out", type=Path, help="the combined JSON (default WORK/gpu_check.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU")
    ap.add_argument("--kernels", help="kernels phase: only these kernels' tests (rotary,race)")
    args = ap.parse_args(argv)
    if (args.phase is None) == (args.phases is None):
        ap.error("name one PHASE, merge, or --phase LIST")
    if args.kernels:
        os.environ["GPU_CHECK_KERNELS"] = args.kernels  # the --phase children inherit it
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or args.work / "gpu_check.json"
    if args.phases:
        return run_phases(args.phases, args.work, args.smoke, out)
    if args.phase == "merge":
        return merge(args.work, out)
    return run_phase(args.phase, args.work, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
