"""One stream's sampling options must not slow the other 31 (issue 17).

Starts `stoker serve` on the bundled model for each mode, runs 32 concurrent streams of
sequential completions, and compares aggregate output tok/s between a run where no stream uses
penalties, logit_bias or logprobs and one where stream 0 uses all three. Modes alternate for
`--rounds` rounds (each its own server); the JSON keeps every run and the medians.

    .venv/bin/python benchmarks/sampling_options.py              # ~2-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import httpx
from bench_utils import write_result
from serving import Server

from stoker.common.model_registry import resolve_model

STREAMS = 32
SPECIAL = {
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
    "repetition_penalty": 1.2,
    "logit_bias": {str(t): (2.0 if t % 2 else -2.0) for t in range(100, 132)},
    "logprobs": 5,
}


async def _stream(
    client: httpx.AsyncClient, i: int, args, special: bool, warm_up: bool
) -> tuple[int, float]:
    rng = random.Random(i + (1000 if warm_up else 0))
    tokens, t0 = 0, time.monotonic()
    for _ in range(1 if warm_up else args.requests):
        body = {
            "prompt": [rng.randrange(10, 4000) for _ in range(args.input_len)],
            "max_tokens": 8 if warm_up else args.output_len,
            "temperature": 1.0,
            "ignore_eos": True,
            **(SPECIAL if special and i == 0 else {}),
        }
        r = await client.post("/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        tokens += r.json()["usage"]["completion_tokens"]
    return tokens, time.monotonic() - t0


async def _load(port: int, args, special: bool, warm_up: bool = False) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        t0 = time.monotonic()
        done = await asyncio.gather(
            *(_stream(client, i, args, special, warm_up) for i in range(STREAMS))
        )
        wall = time.monotonic() - t0
    total = sum(n for n, _ in done)
    return {
        "output_tok_s": total / wall,
        "seconds": wall,
        "tokens": total,
        "stream0_tok_s": done[0][0] / done[0][1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="stoker-tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=2, help="sequential requests per stream")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args(argv)
    model = str(resolve_model(args.model))
    runs: list[dict] = []
    for _ in range(args.rounds):
        for special in (False, True):
            server = Server(model, ["--max-num-seqs", str(STREAMS)])
            try:
                asyncio.run(_load(server.port, args, special, warm_up=True))  # first steps
                run = asyncio.run(_load(server.port, args, special))
            finally:
                server.stop()
            run["mode"] = "one stream with options" if special else "plain"
            print(run, file=sys.stderr)
            runs.append(run)
    plain = statistics.median(r["output_tok_s"] for r in runs if r["mode"] == "plain")
    special = statistics.median(r["output_tok_s"] for r in runs if r["mode"] != "plain")
    result = {
        "model": args.model,
        "streams": STREAMS,
        "special_stream": SPECIAL,
        "plain_tok_s": plain,
        "special_tok_s": special,
        "ratio": special / plain,
        "runs": runs,
    }
    print(f"plain {plain:.1f} tok/s, with one option stream {special:.1f} tok/s "
          f"({special / plain:.3f}x)")  # fmt: skip
    print(write_result("sampling_options", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
