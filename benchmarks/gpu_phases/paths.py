"""paths: the engine's other paths on the device, each against a plain greedy run in float32
(bf16 logits differ between kernels, so only float32 makes token equality a fair check): n-gram
speculation (verify rows through the varlen kernel), prefix caching (a shared prefix, run twice)
and preemption (a KV cache too small for the batch)."""

from __future__ import annotations

import random
import time
from pathlib import Path

from gpu_phases.shared import Report, free, llm, vocab_size

BLOCK = 16  # the engine's default block size


def _prompts(work: Path, smoke: bool) -> list[list[int]]:
    """Four prompts on a shared prefix, four copy-heavy ones (a motif three times)."""
    vocab = vocab_size(work)
    rng = random.Random(3)
    shared = [rng.randrange(3, vocab) for _ in range(40 if smoke else 300)]
    motif = [rng.randrange(3, vocab) for _ in range(8 if smoke else 48)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(5 + i)] for i in range(4)]
    return prompts + [motif * 3 + [rng.randrange(3, vocab)] for _ in range(4)]


def _run(work: Path, label: str, prompts, params, repeat: int = 1, **options):
    """Token ids per prompt from a fresh engine, and the run's record."""
    engine = llm(work, **options)
    started = time.perf_counter()
    for _ in range(repeat):
        outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    stats = engine.engine.scheduler
    record = dict(
        path=label,
        seconds=round(seconds, 2),
        preemptions=stats.num_preemptions,
        prefix_hit_tokens=stats.prefix_hits,
    )
    if stats.spec is not None:
        spec = stats.spec.stats
        record.update(draft_tokens=spec.draft_tokens, accepted_tokens=spec.accepted_tokens)
    del engine
    free()
    return [o.token_ids for o in outs], record


def run(work: Path, smoke: bool, report: Report) -> bool:
    from stoker.common.sampling_params import SamplingParams

    prompts = _prompts(work, smoke)
    new = 16 if smoke else 96
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    base = dict(dtype="float32", max_model_len=128 if smoke else 1024, max_num_seqs=8)
    want, record = _run(work, "plain", prompts, params, **base, enable_prefix_caching=False)
    report.add(**record)
    small_cache = 3 * -(-(len(prompts[0]) + new) // BLOCK)  # blocks for 3 of the 8 requests
    # (label, engine options, the count that shows the path really ran)
    variants = [
        ("ngram", dict(enable_prefix_caching=False, speculative="ngram"), "accepted_tokens"),
        ("prefix_cache_twice", dict(enable_prefix_caching=True, repeat=2), "prefix_hit_tokens"),
        ("preempt", dict(enable_prefix_caching=False, num_kv_blocks=small_cache), "preemptions"),
    ]
    ok = True
    for label, options, exercised in variants:
        got, record = _run(work, label, prompts, params, **(base | options))
        same = [g == w for g, w in zip(got, want)]
        record["identical_requests"] = sum(same)
        record["requests"] = len(same)
        record["ok"] = all(same) and record[exercised] > 0
        ok = ok and record["ok"]
        report.add(**record)
        print("paths:", record)
    return ok
