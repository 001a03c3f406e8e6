"""profile: where the time goes, for the next optimisation to aim at: torch.profiler's top kernels
by device time over batch-1 greedy decode (the CUDA-graph path) and over a slice of the nano-vllm
workload, and cProfile's top functions over eager batch-1 forwards (the host cost of a
launch-bound step) and over the same slice. Each table goes to the log and to
WORK/profile_NAME.txt."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from gpu_phases.shared import (
    Report,
    StepTimes,
    batch1_forward,
    cuda,
    free,
    llm,
    nano_vllm_workload,
    random_prompt,
    workload_options,
)


class Profiles:
    """Where the tables go: WORK/profile_NAME.txt, the log, and a record of the top rows."""

    def __init__(self, work: Path, report: Report) -> None:
        from torch.profiler import ProfilerActivity

        self.work, self.report = work, report
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda() else [])
        sort = "self_device_time_total" if cuda() else "self_cpu_time_total"
        if cuda() and not hasattr(torch.autograd.profiler_util.FunctionEventAvg(), sort):
            sort = "self_cuda_time_total"  # the older name
        self.sort = sort

    def profiler(self):
        from torch.profiler import profile

        return profile(activities=self.activities)

    def save(self, name: str, text: str) -> None:
        (self.work / f"profile_{name}.txt").write_text(text)
        print(f"== profile {name}\n{text}")

    def top(self, prof, name: str, **extra) -> None:
        events = prof.key_averages()
        self.save(name, events.table(sort_by=self.sort, row_limit=30, max_name_column_width=80))
        rows = sorted(events, key=lambda e: getattr(e, self.sort), reverse=True)[:30]
        self.report.add(
            profile=name,
            **extra,
            top=[
                dict(name=e.key[:120], calls=e.count, self_device_us=round(getattr(e, self.sort)),
                     self_cpu_us=round(e.self_cpu_time_total))
                for e in rows
            ],
        )  # fmt: skip


def _host_table(profiler: cProfile.Profile, *sorts: tuple[str, int]) -> str:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for key, rows in sorts:
        stats.sort_stats(key).print_stats(rows)
    return text.getvalue()


def _decode(work: Path, smoke: bool, out: Profiles) -> None:
    """torch.profiler over batch-1 greedy decode, then cProfile over eager batch-1 forwards with
    the graphs set aside: what each step costs the host."""
    from stoker.common.sampling_params import SamplingParams

    prompt = random_prompt(work, 2, 16 if smoke else 128)
    greedy = dict(temperature=0.0, ignore_eos=True)
    new = 8 if smoke else 64
    engine = llm(work, max_model_len=2048, max_num_seqs=1, num_kv_blocks=256)
    engine.generate([prompt], SamplingParams(max_tokens=16, **greedy), use_tqdm=False)  # warm-up
    with out.profiler() as prof:
        engine.generate([prompt], SamplingParams(max_tokens=new, **greedy), use_tqdm=False)
    out.top(prof, "decode_batch1", new_tokens=new)

    runner = engine.engine.runner
    graphs, runner.graphs = runner.graphs, None
    forward = batch1_forward(runner, len(prompt))
    calls = 3 if smoke else 20
    with torch.inference_mode():
        forward()
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        for _ in range(calls):
            forward()
        if cuda():
            torch.cuda.synchronize()
        profiler.disable()
        eager_ms = (time.perf_counter() - started) / calls * 1e3
    runner.graphs = graphs
    table = _host_table(profiler, ("tottime", 30))
    out.save("eager_host", f"{calls} eager batch-1 forwards, {eager_ms:.2f} ms each\n{table}")
    out.report.set(eager_forward_ms_under_cprofile=round(eager_ms, 2))
    del engine, runner, graphs, forward
    free()


def _workload_slice(work: Path, smoke: bool, out: Profiles) -> None:
    """A slice of the nano-vllm workload (128 requests of at most 128 tokens) under
    torch.profiler, then under cProfile alone: which host functions a step's wall time goes to."""
    from stoker.common.sampling_params import SamplingParams

    prompts, params = nano_vllm_workload(smoke)
    count = cap = 8 if smoke else 128
    prompts = prompts[:count]
    params = [
        SamplingParams(
            temperature=sp.temperature, ignore_eos=True, max_tokens=min(sp.max_tokens, cap)
        )
        for sp in params[:count]
    ]
    engine = llm(work, **workload_options(smoke))
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps = StepTimes(engine.engine.runner)
    started = time.perf_counter()
    with out.profiler() as prof:
        outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    out.top(prof, "throughput_slice", requests=count, output_tokens=tokens,
            seconds_under_profiler=round(seconds, 2), **steps.summary())  # fmt: skip

    steps.reset()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    engine.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - started
    summary = steps.summary()
    table = _host_table(profiler, ("tottime", 40), ("cumulative", 60))
    out.save("host_throughput_slice", f"{count} requests, {seconds:.2f} s, {summary}\n{table}")
    out.report.set(host_slice_seconds_under_cprofile=round(seconds, 2), host_slice_steps=summary)


def run(work: Path, smoke: bool, report: Report) -> bool:
    out = Profiles(work, report)
    _decode(work, smoke, out)
    _workload_slice(work, smoke, out)
    return True
