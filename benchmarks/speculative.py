"""Speculative decoding: decode tok/s with and without speculation, on the bundled pair.

Greedy, in one run: batch 1 and batch 8 on Shakespeare prompts with no speculation, n-gram and
the bundled draft; then a copy-heavy workload (the answer repeats long spans of the prompt) for
n-gram. Outputs are checked to be identical to the non-speculative run. Also sweeps the batch
size to show where speculation stops paying (the adaptive cut-off). Writes JSON results.

Each arm reports tok/s end to end and decode tok/s, which leaves out the prefill (the time to
each batch's first token): speculation shortens only decode, and the copy-heavy prompts are
long enough that their prefill is a third of a speculating arm's time. k is fixed unless
`--adaptive` asks for the served policy.

    .venv/bin/python benchmarks/speculative.py [--max-tokens 128]

With an EAGLE head (docs/speculation.md) an `eagle` arm joins, and a chat workload (held-out
questions through the model's chat template) runs when the tokenizer has one:

    .venv/bin/python benchmarks/speculative.py --model smollm2 --eagle models/smollm2-eagle \
        --no-draft

(On SmolLM2 `--speculative draft` itself loads that bundled head, so its draft arm would repeat
the eagle arm.)
"""

from __future__ import annotations

import argparse
import time

from bench_utils import write_result

from stoker.common.config import DEFAULT_MODEL
from stoker.common.model_registry import default_draft, resolve_model
from stoker.services.engine import LLM, SamplingParams
from stoker.tools.training.train_draft import chat_prompt_ids

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
    "draft": {"speculative": "draft", "speculative_ngram_first": False},  # the draft alone
}
# Not in any training prompt file of this repo: held out for heads trained by train-draft.
CHAT_PROMPTS = [
    "What are three good habits for writing clear emails?",
    "Explain in a few sentences why the sky looks blue.",
    "Give me a short recipe for a vegetable soup.",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery and explain it.",
    "Why do we have leap years?",
    "Write a haiku about a quiet morning.",
]


def chat_prompts(llm: LLM) -> list[list[int]] | None:
    tok = llm.tokenizer
    if not getattr(tok, "chat_template", None):
        return None
    return chat_prompt_ids(tok, CHAT_PROMPTS)


def run(llm: LLM, prompts: list, batch: int, params: SamplingParams) -> tuple[float, float, list]:
    """Generate `prompts` `batch` at a time. Returns (tok/s end to end, decode tok/s, token
    ids). Decode tok/s leaves out each batch's prefill, which speculation cannot shorten: the
    tokens after each first token over the time from a batch's first first token to its last
    finish."""
    outs, decode_tokens, decode_seconds = [], 0, 0.0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = [o.outputs[0] for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
        firsts = [c.metrics.first_token_time for c in group]
        lasts = [c.metrics.finished_time for c in group]
        assert None not in firsts and None not in lasts
        decode_seconds += max(lasts) - min(firsts)  # type: ignore[type-var]
        decode_tokens += sum(len(c.token_ids) - 1 for c in group)
        outs += group
    seconds = time.perf_counter() - start
    tps = sum(len(o.token_ids) for o in outs) / seconds
    return tps, decode_tokens / decode_seconds, [o.token_ids for o in outs]


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
    ap.add_argument("--k", type=int, help="drafts per verify (default: the engine's per method)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="target (name or folder)")
    ap.add_argument("--eagle", help="an EAGLE head folder for --model: adds the eagle arm")
    ap.add_argument("--no-draft", action="store_true", help="skip the bundled draft's arm")
    ap.add_argument(
        "--workloads",
        nargs="+",
        choices=("shakespeare", "chat", "copy-heavy"),
        default=("shakespeare", "chat", "copy-heavy"),
    )
    ap.add_argument("--no-sweep", action="store_true", help="skip the by-batch-size sweep")
    ap.add_argument("--dtype", default="float32", help="the target's (and heads') dtype")
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="the served default (adaptive k, sitting out, the batch cut-off) instead of fixed k",
    )
    a = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    modes = {m: o for m, o in MODES.items() if not (a.no_draft and m == "draft")}
    if a.eagle:  # the head alone, and as served by default: n-gram matches first
        modes["eagle"] = {"speculative_model": a.eagle, "speculative_ngram_first": False}
        modes["eagle+ngram"] = {"speculative_model": a.eagle}
    engines = {
        mode: LLM(
            a.model,
            num_speculative_tokens=a.k,
            # By default measure speculation itself; adaptivity is swept below.
            speculative_adaptive=a.adaptive,
            # Every arm prefills every prompt: the plain engine generated the copy-heavy
            # prompts' continuations, and with its prefix cache it alone would skip their prefill.
            enable_prefix_caching=False,
            dtype=a.dtype,
            **opts,
        )
        for mode, opts in modes.items()
    }
    copy_prompts = copy_heavy_prompts(engines["none"], a.max_tokens)
    draft = str(default_draft(resolve_model(a.model)))  # what `--speculative draft` loads
    k_by_mode = {m: llm.engine.config.num_speculative_tokens for m, llm in engines.items()}
    k_by_mode.pop("none")
    results: dict = {
        "model": a.model,
        "draft": draft,
        "k": k_by_mode,
        "dtype": a.dtype,
        "adaptive": a.adaptive,
    }
    if a.eagle:
        results["eagle"] = a.eagle
    workloads = [("shakespeare", PROMPTS), ("copy-heavy", copy_prompts)]
    chat = chat_prompts(engines["none"])
    if chat is not None:
        workloads.insert(1, ("chat", chat))
    for workload, prompts in workloads:
        if workload not in a.workloads:
            continue
        for batch in (1, 8):
            base_tps, base_decode, base_ids = 0.0, 0.0, None
            for mode, llm in engines.items():
                if workload == "copy-heavy" and mode in ("draft", "eagle"):
                    continue
                llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
                before = _spec_counts(llm)
                tps, decode_tps, ids = run(llm, prompts, batch, params)
                after = _spec_counts(llm)
                row = {"tok_per_s": round(tps, 1), "decode_tok_per_s": round(decode_tps, 1)}
                if mode == "none":
                    base_tps, base_decode, base_ids = tps, decode_tps, ids
                else:
                    drafts = after[0] - before[0]
                    accepted = after[1] - before[1]
                    row["speedup"] = round(tps / base_tps, 2)
                    row["decode_speedup"] = round(decode_tps / base_decode, 2)
                    row["identical_to_no_spec"] = ids == base_ids
                    row["mean_acceptance_length"] = round(1 + accepted / max(drafts, 1), 2)
                results[f"{workload}/batch{batch}/{mode}"] = row
                print(f"{workload:12s} batch {batch}  {mode:11s} {row}", flush=True)

    # Where does speculation stop paying? Draft mode with adaptivity off, by batch size.
    swept = "eagle" if "eagle" in engines else "draft" if "draft" in engines else None
    sweep = {}
    for batch in (1, 2, 4, 8, 16) if swept and not a.no_sweep else ():
        prompts = (PROMPTS * 4)[: max(batch, 8)]
        base, _, _ = run(engines["none"], prompts, batch, params)
        spec, _, _ = run(engines[swept], prompts, batch, params)
        sweep[batch] = round(spec / base, 2)
        print(f"sweep batch {batch:3d}: {swept} speedup {sweep[batch]}x", flush=True)
    results[f"{swept}_speedup_by_batch"] = sweep
    print("wrote", write_result("speculative", results))


def _spec_counts(llm: LLM) -> tuple[int, int]:
    spec = llm.engine.scheduler.spec
    return (spec.stats.drafts, spec.stats.accepted_tokens) if spec else (0, 0)


if __name__ == "__main__":
    main()
