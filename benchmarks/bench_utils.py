"""Shared benchmark helpers: the benchmark model, prompt sets, peak RSS, JSON results, and
the per-step host-cost benchmarks' arguments and percentiles."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(os.environ.get("STOKER_BENCH_DIR", REPO / ".bench"))
RESULTS_DIR = REPO / "benchmarks" / "results"

# The engine-core issue's benchmark model: a random-init 12-layer d768 Llama, float32, seed 0.
BENCH_LLAMA = dict(
    vocab_size=32000,
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    intermediate_size=2048,
    max_position_embeddings=2048,
    initializer_range=0.02,
)


def bench_model(name: str = "llama-d768-l12", **overrides) -> Path:
    """Build (once) and return the benchmark model folder."""
    if str(REPO) not in sys.path:  # for tests.*; after site-packages (docs/architecture.md)
        sys.path.append(str(REPO))
    from tests.factory import make_model

    path = BENCH_DIR / name
    if not (path / "config.json").is_file():
        make_model(path, "llama", **{**BENCH_LLAMA, **overrides}, seed=0)
    _cover_vocab(path)
    return path


def _cover_vocab(path: Path) -> None:
    """The test tokenizer has 512 tokens; the model samples ids up to 32000. Give every id a
    text (plain added tokens) so streamed outputs are never empty and TTFT/ITL mean something."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    if len(tok) < vocab:
        tok.add_tokens([f" w{i}" for i in range(len(tok), vocab)])
        tok.save_pretrained(path)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Same recipe as the vLLM-CPU peer's offline.py, so both engines see identical prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_result(name: str, result: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS_DIR / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def steady_decode_args(doc: str, cold: bool = False) -> argparse.Namespace:
    """The arguments of the per-step host-cost benchmarks (scheduler_step.py, worker_step.py);
    cold: offer --cold-mib."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    if cold:
        ap.add_argument(
            "--cold-mib",
            type=int,
            default=0,
            help="touch this many MiB between steps, leaving caches cold as the server's other\n"
            "processes do between its steps (0: warm)",
        )
    return ap.parse_args()


def p50_p99_us(seconds: list[float]) -> dict:
    xs = sorted(seconds)
    return {
        "p50_us": round(statistics.median(xs) * 1e6, 1),
        "p99_us": round(xs[int(0.99 * (len(xs) - 1))] * 1e6, 1),
    }
