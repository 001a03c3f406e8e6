"""throughput: the nano-vllm workload (256 requests, input and output lengths uniform 100-1024,
seed 0, temperature 0.6), then on the same engine with its loop serial, for what overlap buys."""

from __future__ import annotations

import time
from pathlib import Path

from gpu_phases.shared import Report, StepTimes, llm, nano_vllm_workload, workload_options

HF_GENERATE_BATCH_TOK_S = 794  # HF continuous batching on the same H200, from the issue


def run(work: Path, smoke: bool, report: Report) -> bool:
    from stoker.common.sampling_params import SamplingParams

    prompts, params = nano_vllm_workload(smoke)
    started = time.perf_counter()
    options = workload_options(smoke)
    engine = llm(work, **options, overlap=True if smoke else None)
    runner = engine.engine.runner
    report.set(
        init_s=round(time.perf_counter() - started, 1),
        num_kv_blocks=runner.num_blocks,
        options=options,
        hf_generate_batch_tok_s=HF_GENERATE_BATCH_TOK_S,
        target_tok_s=25000,
    )
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps = StepTimes(runner)
    replays = runner.graphs.num_replays if runner.graphs else 0
    started = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    out_tokens = sum(len(o.token_ids) for o in outs)
    report.set(
        requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=out_tokens,
        seconds=round(seconds, 2),
        output_tok_s=round(out_tokens / seconds, 1),
        graph_steps=(runner.graphs.num_replays - replays) if runner.graphs else 0,
        preemptions=engine.engine.scheduler.num_preemptions,
        **steps.summary(),
    )
    if engine.engine.overlap:  # the same engine, drained, with its loop serial
        engine.engine.overlap = False
        started = time.perf_counter()
        serial = engine.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        engine.engine.overlap = True
        serial_tokens = sum(len(o.token_ids) for o in serial)
        report.set(overlap=True, serial_loop_output_tok_s=round(serial_tokens / seconds, 1))
    print("throughput:", {k: v for k, v in report.data.items() if k != "records"})
    return out_tokens == sum(p.max_tokens for p in params)
