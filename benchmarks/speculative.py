"""Speculative decoding: decode tok/s with and without speculation, on the bundled pair.

Greedy, in one run: batch 1 and batch 8 on Shakespeare prompts with no speculation, n-gram and
the bundled draft; then a copy-heavy workload (the answer repeats long spans of the prompt) for
n-gram. Outputs are checked to be identical to the non-speculative run. Also sweeps the batch
size to show where speculation stops paying (the adaptive cut-off). Writes JSON results.

    .venv/bin/python benchmarks/speculative.py [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import time

from bench_utils import write_result

from common.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from services.engine import LLM, SamplingParams

PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "KING HENRY:\nOnce more unto the breach,",
    "HAMLET:\nTo be, or not to be,",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "JULIET:\nO Romeo, Romeo!",
    "MACBETH:\nIs this a dagger which I see",
    "PORTIA:\nThe quality of mercy",
    "LEAR:\nBlow, winds, and crack your cheeks!",
]
MODES = {
    "none": {},
    "ngram": {"speculative": "ngram"},
    "draft": {"speculative": "draft"},
}


def run(llm: LLM, prompts: list, batch: int, params: SamplingParams) -> tuple[float, list]:
    """Decode tok/s generating `prompts` `batch` at a time; returns (tok/s, token ids)."""
    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def copy_heavy_prompts(llm: LLM, max_tokens: int) -> list[list[int]]:
    """prompt + its greedy continuation + the prompt again: answering repeats the earlier span."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    firsts = llm.generate(PROMPTS, greedy, use_tqdm=False)
    tok = llm.tokenizer
    sep = tok.encode("\n\n")
    return [o.prompt_token_ids + o.token_ids + sep + o.prompt_token_ids for o in firsts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    engines = {
        mode: LLM(
            DEFAULT_MODEL,
            num_speculative_tokens=a.k,
            speculative_adaptive=False,  # measure speculation itself; adaptivity is swept below
            **opts,
        )
        for mode, opts in MODES.items()
    }
    copy_prompts = copy_heavy_prompts(engines["none"], a.max_tokens)
    results: dict = {"model": str(DEFAULT_MODEL), "draft": str(DEFAULT_DRAFT_MODEL), "k": a.k}
    for workload, prompts in (("shakespeare", PROMPTS), ("copy-heavy", copy_prompts)):
        for batch in (1, 8):
            base_tps, base_ids = None, None
            for mode, llm in engines.items():
                if workload == "copy-heavy" and mode == "draft":
                    continue
                llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
                before = _spec_counts(llm)
                tps, ids = run(llm, prompts, batch, params)
                after = _spec_counts(llm)
                row = {"tok_per_s": round(tps, 1)}
                if mode == "none":
                    base_tps, base_ids = tps, ids
                else:
                    drafts = after[0] - before[0]
                    accepted = after[1] - before[1]
                    row["speedup"] = round(tps / base_tps, 2)
                    row["identical_to_no_spec"] = ids == base_ids
                    row["mean_acceptance_length"] = round(1 + accepted / max(drafts, 1), 2)
                results[f"{workload}/batch{batch}/{mode}"] = row
                print(f"{workload:12s} batch {batch}  {mode:6s} {row}", flush=True)

    # Where does speculation stop paying? Draft mode with adaptivity off, by batch size.
    sweep = {}
    for batch in (1, 2, 4, 8, 16):
        prompts = (PROMPTS * 4)[: max(batch, 8)]
        base, _ = run(engines["none"], prompts, batch, params)
        spec, _ = run(engines["draft"], prompts, batch, params)
        sweep[batch] = round(spec / base, 2)
        print(f"sweep batch {batch:3d}: draft speedup {sweep[batch]}x", flush=True)
    results["draft_speedup_by_batch"] = sweep
    print("wrote", write_result("speculative", results))


def _spec_counts(llm: LLM) -> tuple[int, int]:
    spec = llm.engine.scheduler.spec
    return (spec.stats.drafts, spec.stats.accepted_tokens) if spec else (0, 0)


if __name__ == "__main__":
    main()
