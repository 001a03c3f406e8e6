"""benchmarks/gpu_check.sh in its CPU smoke mode: every phase at tiny shapes, the kernel phase
under the triton interpreter, so the script that runs on a lent GPU cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about 50 s on 2 cores
@pytest.mark.timeout(300)
def test_gpu_check_smoke_runs_every_phase(tmp_path):
    pytest.importorskip("triton")
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        OUT=str(tmp_path / "out"),
        GPU_CHECK_WORK=str(tmp_path / "work"),
        TRITON_INTERPRET="1",
    )
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert done.returncode == 0, log[-4000:]
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    phases = result["phases"]
    assert result["ok"] and set(phases) == {
        "model",
        "kernels",
        "hf",
        "decode",
        "throughput",
        "timing",
        "serve",
        "paths",
        "profile",
    }
    assert all(p["exit"] == "0" for p in phases.values())

    kernels = phases["kernels"]["records"]
    names = {r["kernel"] for r in kernels}
    assert {"decode", "decode_split", "prefill_paged", "causal", "varlen", "store_kv"} <= names
    assert {"rms_norm", "add_rms_norm", "qk_rms_norm", "rotary", "rotary_by_position"} <= names
    assert "race" in names
    assert all(r["ok"] for r in kernels)
    assert all(r["generated_identical"] for r in phases["hf"]["records"])  # float32 on CPU
    decode = {r["cuda_graphs"]: r for r in phases["decode"]["records"]}
    assert decode[True]["ms_per_token"] > 0 and decode[False]["ms_per_token"] > 0
    assert phases["decode"]["identical_tokens_with_and_without_graphs"]
    throughput = phases["throughput"]
    assert throughput["output_tokens"] > 0 and throughput["graph_steps"] > 0
    assert throughput["overlap"] and throughput["serial_loop_output_tok_s"] > 0
    assert decode[True]["overlap"] and decode[True]["serial_loop_ms_per_token"] > 0
    assert {r["kernel"] for r in phases["timing"]["records"]} >= {"paged_decode_attention"}
    serve = phases["serve"]
    assert serve["bench"]["completed"] == serve["bench"]["num_prompts"]
    assert serve["kv_free_blocks"] == serve["kv_total_blocks"]  # nothing leaked at idle
    paths = {r["path"]: r for r in phases["paths"]["records"]}
    assert set(paths) == {"plain", "ngram", "prefix_cache_twice", "preempt"}
    assert paths["ngram"]["accepted_tokens"] > 0 and paths["preempt"]["preemptions"] > 0
    assert all(r["identical_requests"] == r["requests"] for n, r in paths.items() if n != "plain")
    profiles = {r["profile"]: r for r in phases["profile"]["records"]}
    assert set(profiles) == {"decode_batch1", "throughput_slice"}
    assert all(r["top"] for r in profiles.values())
    for name in ("decode_batch1", "eager_host", "throughput_slice", "host_throughput_slice"):
        assert (tmp_path / "out" / f"profile_{name}.txt").read_text().strip()
