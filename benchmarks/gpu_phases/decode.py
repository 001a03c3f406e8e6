"""decode: batch-1 greedy decode ms/token with and without CUDA graphs (on CPU the graph path
runs in its eager-replay mode), the model forward alone, and the same engine's serial loop."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gpu_phases.shared import (
    Report,
    StepTimes,
    batch1_forward,
    bench,
    copy_bandwidth,
    free,
    llm,
    random_prompt,
    weight_bytes,
)

# Reference points from the issue (HF on the same H200).
HF_DECODE_MS = {"dynamic_cache": 25.3, "static_cache_compiled": 3.46}
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _generate_s(engine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    from stoker.common.sampling_params import SamplingParams

    started = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(max_tokens=tokens, **GREEDY), use_tqdm=False)
    return time.perf_counter() - started, out[0].token_ids


def _measure(work: Path, smoke: bool, prompt: list[int], graphs: bool, report: Report):
    """One engine, graphs on or off: the record, and the tokens of its last full run."""
    new = 8 if smoke else 256
    engine = llm(
        work,
        max_model_len=2048,
        max_num_seqs=1,
        num_kv_blocks=256,
        enforce_eager=not graphs,
        overlap=True if smoke else None,  # the smoke run exercises the overlapped loop too
    )
    runner = engine.engine.runner
    _generate_s(engine, prompt, 16)  # warm-up
    steps = StepTimes(runner)
    firsts, totals = [], []
    for _ in range(3):  # ms/token = (best time for `new` tokens - best for 1) / (new - 1)
        firsts.append(_generate_s(engine, prompt, 1)[0])
        steps.reset()
        seconds, tokens = _generate_s(engine, prompt, new)
        totals.append(seconds)
    step_times = steps.summary()  # before the serial comparison below adds its steps
    serial_ms = None
    if graphs and engine.engine.overlap:  # the same engine with its loop serial, for comparison
        engine.engine.overlap = False
        serial_ms = (_generate_s(engine, prompt, new)[0] - min(firsts)) / (new - 1) * 1e3
        engine.engine.overlap = True
    # The model forward alone at batch 1, context ~len(prompt): replay vs eager launches.
    forward = batch1_forward(runner, len(prompt))
    with torch.inference_mode():
        forward_s = bench(forward, iters=5 if smoke else 100)
    report.add(
        cuda_graphs=graphs,
        overlap=engine.engine.overlap,
        serial_loop_ms_per_token=None if serial_ms is None else round(serial_ms, 3),
        captured=runner.graphs is not None and runner.graphs._entries[1].graph is not None,
        ms_per_token=round((min(totals) - min(firsts)) / (new - 1) * 1e3, 3),
        one_token_ms_runs=[round(t * 1e3, 2) for t in firsts],
        all_tokens_ms_runs=[round(t * 1e3, 2) for t in totals],
        forward_only_ms=round(forward_s * 1e3, 3),
        **step_times,
    )
    print("decode:", report.data["records"][-1])
    del engine, runner, forward
    free()
    return tokens


def run(work: Path, smoke: bool, report: Report) -> bool:
    prompt = random_prompt(work, 2, 16 if smoke else 128)
    weights = weight_bytes(work)
    bandwidth = copy_bandwidth(smoke)
    report.set(
        weight_bytes=weights,
        copy_gb_s=round(bandwidth / 1e9, 1),
        weight_read_floor_ms=round(weights / bandwidth * 1e3, 3),
        hf_reference_ms=HF_DECODE_MS,
        target_ms=1.0,
    )
    tokens = {graphs: _measure(work, smoke, prompt, graphs, report) for graphs in (True, False)}
    report.set(identical_tokens_with_and_without_graphs=tokens[True] == tokens[False])
    return True
