"""What several phases share: the report, the device and dtype, the timer, the engine on the
phase-built model, the nano-vllm workload and the batch-1 forward."""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    initializer_range=0.02,
)
SMOKE_MODEL = dict(
    QWEN3_0_6B,
    vocab_size=1024,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=128,
)


class Report:
    """One phase's JSON, rewritten after every record so a timeout keeps what was measured."""

    def __init__(self, path: Path, phase: str, smoke: bool) -> None:
        self.path = path
        self.data: dict = {"phase": phase, "smoke": smoke, "ok": None, "records": []}
        self.data["device"] = torch.cuda.get_device_name() if cuda() else "cpu"
        self.save()

    def add(self, **record) -> None:
        self.data["records"].append(record)
        self.save()

    def set(self, **values) -> None:
        self.data.update(values)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda" if cuda() else "cpu")


def dtype() -> torch.dtype:
    return torch.bfloat16 if cuda() else torch.float32


def dtype_name() -> str:
    return str(dtype()).removeprefix("torch.")


def bench(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Seconds per call: CUDA events on the GPU, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    if not cuda():
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000 / iters


def copy_bandwidth(smoke: bool) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read and written."""
    nbytes = 64 * 1024**2 if smoke else 2 * 1024**3
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device())
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src), iters=10)


def free() -> None:
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def model_path(work: Path) -> Path:
    return work / "model"


def vocab_size(work: Path) -> int:
    return json.loads((model_path(work) / "config.json").read_text())["vocab_size"]


def weight_bytes(work: Path) -> int:
    return sum(f.stat().st_size for f in model_path(work).glob("*.safetensors"))


def llm(work: Path, **options):
    """The in-process engine on the phase-built model; on CPU the decode-graph path still runs,
    in its eager-replay mode, unless the options turn graphs off."""
    from stoker.services.engine import LLM

    base = dict(device=str(device()), dtype=dtype_name())
    engine = LLM(str(model_path(work)), **(base | options))
    if not cuda() and not options.get("enforce_eager"):
        engine.engine.runner.use_decode_graphs(capture=False)
    return engine


def random_prompt(work: Path, seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    vocab = vocab_size(work)
    return [rng.randrange(3, vocab) for _ in range(length)]


class StepTimes:
    """Sums the worker's own step telemetry (prepare / forward / sample) over a run."""

    def __init__(self, runner) -> None:
        self.reset()
        execute = runner.execute

        def timed(plan):
            result = execute(plan)
            if result.req_ids:
                self.steps += 1
                self.prepare_s += result.prepare_s
                self.forward_s += result.forward_s
                self.sample_s += result.sample_s
            return result

        runner.execute = timed

    def reset(self) -> None:
        self.steps = 0
        self.prepare_s = self.forward_s = self.sample_s = 0.0

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "worker_prepare_s": round(self.prepare_s, 3),
            "worker_forward_s": round(self.forward_s, 3),
            "worker_sample_s": round(self.sample_s, 3),
        }


def nano_vllm_workload(smoke: bool):
    """nano-vllm's bench.py: seed 0, 256 prompts of randint(0, 10000) ids with lengths
    randint(100, 1024), then temperature 0.6, ignore_eos, max_tokens randint(100, 1024)."""
    from stoker.common.sampling_params import SamplingParams

    rng = random.Random(0)
    count, lo, hi, top_id = (8, 5, 30, 1000) if smoke else (256, 100, 1024, 10000)
    prompts = [[rng.randint(0, top_id) for _ in range(rng.randint(lo, hi))] for _ in range(count)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(lo, hi))
        for _ in range(count)
    ]
    return prompts, params


def workload_options(smoke: bool) -> dict:
    """Engine limits for the workload: the full batch on the GPU, a tiny one on CPU."""
    if smoke:
        return dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    return dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)


def batch1_forward(runner, prompt_len: int) -> Callable[[], object]:
    """The model forward alone for one decode row at context prompt_len + 1: the graph replay,
    or the eager launches when the runner has no graphs."""
    from stoker.services.worker.step_inputs import Chunk, build_step_inputs

    blocks = list(range(-(-(prompt_len + 1) // runner.block_size)))
    chunk = Chunk([5], prompt_len, blocks, 1)
    if runner.graphs is not None:
        with torch.inference_mode():
            runner.graphs.prepare([chunk])
        entry, _ = runner.graphs._pending
        if entry.graph is not None:
            return entry.graph.replay
        return lambda: runner.graphs._forward(entry)
    inputs = build_step_inputs([chunk], runner.block_size, device())
    model, caches = runner.model, runner.kv_caches
    return lambda: model(inputs.input_ids, inputs.positions, caches, inputs.meta)
