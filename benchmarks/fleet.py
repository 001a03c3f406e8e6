"""The fleet's prefix-cache hit rate and throughput, cache-aware routing against round robin.

For each policy: a fresh `stoker serve --replicas N --router smg --router-policy P` (so no run
warms the next), one shared-prefix workload through the router with the official openai
client, the replicas' prefix-cache counters read from their /metrics before and after. JSON
lands in benchmarks/results/fleet-*.json.

    .venv/bin/python benchmarks/fleet.py                         # 2 replicas of stoker-tiny
    .venv/bin/python benchmarks/fleet.py --replicas 3 --null-model --groups 64
    .venv/bin/python benchmarks/fleet.py --num-kv-blocks 256     # caches too small for all prefixes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path

from bench_utils import write_result
from openai import AsyncOpenAI

from stoker.tools.fleet.workload import shared_prefix_prompts
from tests.fleet.fleet_procs import start_fleet, stop_fleet


async def _drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int):
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(concurrency)
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "failed": 0}

    async def one(prompt: str) -> None:
        async with gate:
            try:
                out = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
                )
            except Exception:
                usage["failed"] += 1
                return
            usage["prompt_tokens"] += out.usage.prompt_tokens
            usage["completion_tokens"] += out.usage.completion_tokens
            details = out.usage.prompt_tokens_details
            usage["cached_tokens"] += (details.cached_tokens or 0) if details else 0

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    await client.close()
    return wall, usage


def run_policy(args: argparse.Namespace, policy: str, seed: int) -> dict:
    extra = ["--router-policy", policy]
    if args.num_kv_blocks:
        extra += ["--num-kv-blocks", str(args.num_kv_blocks)]
    with tempfile.TemporaryDirectory(prefix="stoker-bench-fleet-") as run_dir:
        fleet = start_fleet(Path(run_dir), args.replicas, extra, args.model, args.null_model)
        try:
            # Same prompts for both policies: a fresh fleet each, so nothing is warm.
            prompts = shared_prefix_prompts(args.groups, args.per_group, args.prefix_words, seed)
            before = [fleet.counters(i) for i in range(args.replicas)]
            wall, usage = asyncio.run(
                _drive(fleet.url, args.model, prompts, args.concurrency, args.max_tokens)
            )
            after = [fleet.counters(i) for i in range(args.replicas)]
        finally:
            stop_fleet(fleet)
    per = [a - b for a, b in zip(after, before, strict=True)]
    queries = sum(p.queries for p in per)
    hits = sum(p.hits for p in per)
    return {
        "policy": policy,
        "requests": len(prompts),
        "failed": usage["failed"],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(prompts) / wall, 2),
        "output_tok_per_s": round(usage["completion_tokens"] / wall, 1),
        "prompt_tok_per_s": round(usage["prompt_tokens"] / wall, 1),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_queries": queries,
        "prefix_hits": hits,
        "cached_tokens_reported": usage["cached_tokens"],
        "replica_hit_rates": [round(p.hit_rate, 4) for p in per],
        "replica_query_share": [round(p.queries / queries, 3) if queries else 0 for p in per],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="stoker-tiny")
    p.add_argument("--null-model", action="store_true", help="no model compute in the replicas")
    p.add_argument("--groups", type=int, default=32, help="distinct shared prefixes")
    p.add_argument("--per-group", type=int, default=8, help="requests per prefix")
    p.add_argument("--prefix-words", type=int, default=150, help="about 1.3 tokens a word")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="per replica")
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    runs = [run_policy(args, policy, args.seed) for policy in args.policies.split(",")]
    result = {
        "benchmark": "fleet",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k != "policies"},
        "runs": runs,
    }
    path = write_result("fleet", result)
    for r in runs:
        print(
            f"{r['policy']:>12}: hit rate {r['prefix_hit_rate']:.3f}  {r['requests_per_s']:6.2f} "
            f"req/s  {r['output_tok_per_s']:7.1f} out tok/s  failed {r['failed']}  "
            f"share {r['replica_query_share']}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
