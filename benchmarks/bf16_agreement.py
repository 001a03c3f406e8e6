"""Greedy agreement between stoker and Hugging Face transformers in bfloat16 on CPU.

In bfloat16 the two engines round differently (fused kernels, the order of reductions, where
activations are cast), so exact equality can't be promised: near-ties flip and the outputs part
from there. This measures how often they agree, on the same weights cast to bfloat16, greedy:
- the share of prompts whose whole output is identical;
- the mean share of output tokens before the first divergence;
- the same for float32, as the control (which must be 100 %).
Prompts: stoker eval's golden set (plain and chat-templated) plus random token prompts.

    .venv/bin/python benchmarks/bf16_agreement.py [--model smollm2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_utils import write_result  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from stoker.common.model_registry import resolve_model  # noqa: E402
from stoker.services.engine import LLM, SamplingParams  # noqa: E402
from stoker.tools.eval.sources import load_items  # noqa: E402


def _prompts(folder: Path, num_random: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for item in load_items():
        if item.messages is not None:
            ids = tok.apply_chat_template(item.messages, add_generation_prompt=True)
            prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
        else:
            prompts.append(tok(item.prompt)["input_ids"])
    rng = random.Random(0)
    prompts += [[rng.randrange(100, len(tok)) for _ in range(32)] for _ in range(num_random)]
    return prompts


def _hf(folder: Path, dtype: torch.dtype, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            # Both stop at EOS: min_new_tokens (like any EOS suppression) would mask EOS in
            # HF's argmax where stoker's ignore_eos only keeps going, and the outputs would part.
            y = model.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def _stoker(folder: Path, dtype: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    with LLM(str(folder), dtype=dtype) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        return [o.token_ids for o in llm.generate(prompts, params)]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    prefix = []
    for x, y in zip(a, b):
        same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(1.0 if x == y else same / max(len(x), len(y)))
    return {
        "prompts": len(a),
        "identical_share": sum(p == 1.0 for p in prefix) / len(prefix),
        "mean_agreeing_prefix_share": sum(prefix) / len(prefix),
        "first_divergence_share_per_prompt": prefix,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--random-prompts", type=int, default=16)
    args = parser.parse_args()
    folder = resolve_model(args.model)
    prompts = _prompts(folder, args.random_prompts)
    result: dict = {"model": args.model, "max_tokens": args.max_tokens, "date": time.ctime()}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        hf = _hf(folder, dtype, prompts, args.max_tokens)
        ours = _stoker(folder, name, prompts, args.max_tokens)
        result[name] = _agreement(ours, hf)
        r = result[name]
        print(
            f"{name}: {r['identical_share']:.1%} of {r['prompts']} prompts identical; "
            f"{r['mean_agreeing_prefix_share']:.1%} of tokens before the first divergence"
        )
    print(f"-> {write_result('bf16_agreement', result)}")


if __name__ == "__main__":
    main()
