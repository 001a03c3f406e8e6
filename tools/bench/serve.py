"""`stoker bench serve`: load-test any OpenAI-compatible server (stoker, vLLM, ...).

Sends --num-prompts streamed requests to /v1/completions or /v1/chat/completions, with Poisson
arrivals at --request-rate and at most --max-concurrency in flight, then prints the same
metrics as `vllm bench serve` and optionally writes them as JSON and a PNG.

    stoker bench serve --base-url http://127.0.0.1:8000 --dataset random \\
        --random-input-len 128 --random-output-len 64 --num-prompts 200 \\
        --max-concurrency 16 --ignore-eos --result-json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from stoker.tools.bench import datasets
from stoker.tools.bench.client import RequestResult, build_payload, new_session, send_request
from stoker.tools.bench.datasets import SampleRequest, Tokenizer
from stoker.tools.bench.metrics import METRICS, compute_metrics, format_table
from stoker.tools.bench.plot import have_matplotlib, plot_result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stoker bench serve",
        description="Benchmark an OpenAI-compatible server (like `vllm bench serve`).",
    )
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: host:port)"
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    g.add_argument("--model", default=None, help="model name (default: first id of /v1/models)")
    g.add_argument("--model-path", default=None, help="local model folder (default tokenizer)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer folder (default: --model-path, --model or the server's model root, "
        "whichever is a local folder; none: random-id prompts, word prompts for chat)",
    )
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--timeout", type=float, default=6 * 3600.0, help="per request, seconds")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=["random", "shared-prefix", "jsonl"], default="random")
    g.add_argument("--dataset-path", default=None, help="JSONL of {prompt, max_tokens?} lines")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128, help="also jsonl's default")
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-vocab-size", type=int, default=None, help="ids drawn below this")
    g.add_argument("--shared-prefix-len", type=int, default=256)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("traffic and sampling")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request")
    g = p.add_argument_group("output")
    g.add_argument(
        "--percentile-metrics", default="ttft,tpot,itl", help="shown: ttft,tpot,itl,e2el"
    )
    g.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    g.add_argument("--result-json", default=None)
    g.add_argument("--plot", default=None, help="PNG: latency CDFs and throughput over time")
    g.add_argument("--disable-tqdm", action="store_true")
    return p


def endpoint_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]  # accept an OpenAI-client style base URL too
    return base + "/" + endpoint.lstrip("/")


def fetch_model_card(base_url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    try:
        r = httpx.get(endpoint_url(base_url, "/v1/models"), headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def tokenizer_path(args: argparse.Namespace, card: dict[str, Any] | None) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    for candidate in (args.model_path, args.model, (card or {}).get("root")):
        if candidate and Path(candidate).is_dir():
            return str(candidate)
    return None


def make_requests(
    args: argparse.Namespace, tokenizer: Tokenizer | None, rng: np.random.Generator
) -> list[SampleRequest]:
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        count = partial(datasets.count_tokens, tokenizer=tokenizer)
        return datasets.jsonl_requests(
            args.dataset_path, args.num_prompts, args.random_output_len, count
        )
    vocab = args.random_vocab_size or (
        tokenizer.vocab_size if tokenizer is not None else datasets.DEFAULT_VOCAB_SIZE
    )
    sampler = datasets.TokenSampler(rng, tokenizer, vocab)
    prefix = args.shared_prefix_len if args.dataset == "shared-prefix" else 0
    return datasets.random_requests(
        sampler,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        prefix_len=prefix,
    )


async def arrivals(
    n: int, rate: float, burstiness: float, rng: np.random.Generator
) -> AsyncIterator[int]:
    """Yield 0..n-1 with gamma-distributed gaps of mean 1/rate (exponential: Poisson)."""
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        await asyncio.sleep(float(rng.gamma(burstiness, 1.0 / (rate * burstiness))))


async def run_benchmark(
    url: str,
    payloads: Sequence[dict[str, Any]],
    prompt_lens: Sequence[int],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    timeout: float = 6 * 3600.0,
    disable_tqdm: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send every payload; return the per-request results (in payload order) and the duration."""
    n = len(payloads)
    pool = max_concurrency or n
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = np.random.default_rng(seed + 1)  # arrivals: independent of the prompts' stream
    pbar = tqdm(total=n, disable=disable_tqdm, desc="requests")
    async with new_session(pool, timeout, headers) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            if sem is None:
                res = await send_request(client, url, payloads[i], prompt_lens[i], t0)
            else:
                async with sem:
                    res = await send_request(client, url, payloads[i], prompt_lens[i], t0)
            pbar.update(1)
            return res

        tasks = [
            asyncio.create_task(one(i)) async for i in arrivals(n, request_rate, burstiness, rng)
        ]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    pbar.close()
    return results, duration


def build_result(
    args: argparse.Namespace,
    info: dict[str, Any],
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float],
) -> dict[str, Any]:
    rate = args.request_rate
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        **info,
        "num_prompts": len(results),
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        **compute_metrics(results, duration, percentiles),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "start_times": [r.start for r in results],
        "successes": [r.success for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        parser.error("--request-rate and --burstiness must be positive")
    if args.plot and not have_matplotlib():
        parser.error("--plot needs matplotlib: pip install matplotlib")
    shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(shown) - set(METRICS):
        parser.error(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {METRICS}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        extra = json.loads(args.extra_body) if args.extra_body else None
    except ValueError as e:
        parser.error(str(e))

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    url = endpoint_url(base_url, args.endpoint)
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    card = fetch_model_card(base_url, headers)
    model = args.model or (card or {}).get("id")
    if not model:
        print(f"error: no --model and no model listed at {base_url}/v1/models", file=sys.stderr)
        return 1
    tok_path = tokenizer_path(args, card)
    tokenizer = datasets.load_tokenizer(tok_path) if tok_path else None
    try:
        requests = make_requests(args, tokenizer, np.random.default_rng(args.seed))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    to_text = partial(datasets.to_text, tokenizer=tokenizer)
    payloads = [
        build_payload(
            r,
            model=model,
            chat=chat,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            to_text=to_text,
            extra=extra,
        )
        for r in requests
    ]
    in_lens = [r.prompt_len for r in requests]
    out_lens = [r.output_len for r in requests]
    longest = max(i + o for i, o in zip(in_lens, out_lens))
    if card and card.get("max_model_len") and longest > card["max_model_len"]:
        print(
            f"warning: the longest request needs {longest} tokens but the server's "
            f"max_model_len is {card['max_model_len']}: expect failures",
            file=sys.stderr,
        )
    print(f"Endpoint: {url}  model: {model}  tokenizer: {tok_path or '-'}")
    print(
        f"Dataset: {args.dataset}, {len(requests)} prompts, input tokens "
        f"{min(in_lens)}-{max(in_lens)}, max output tokens {min(out_lens)}-{max(out_lens)}"
    )
    print(f"Traffic request rate: {args.request_rate}  burstiness: {args.burstiness}")
    print(f"Maximum request concurrency: {args.max_concurrency}")

    results, duration = asyncio.run(
        run_benchmark(
            url,
            payloads,
            in_lens,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            headers=headers,
            timeout=args.timeout,
            disable_tqdm=args.disable_tqdm,
        )
    )
    info = {
        "backend": "openai-chat" if chat else "openai",
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": tok_path,
        "dataset": args.dataset,
    }
    result = build_result(args, info, results, duration, percentiles)
    print(format_table(result, args.max_concurrency, args.request_rate, percentiles, shown))
    errors = sorted({r.error for r in results if not r.success})
    for err in errors[:5]:
        print(f"error ({sum(r.error == err for r in results)}x): {err[:300]}", file=sys.stderr)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result, f)
            f.write("\n")
        print(f"wrote {args.result_json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_result(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
