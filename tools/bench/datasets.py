"""Benchmark prompts: random token ids, a shared prefix plus random suffixes, or a JSONL file.

Random prompts are token-id lists, so input lengths are exact without a tokenizer: both stoker
and vLLM accept `prompt: [int, ...]` on /v1/completions. Chat needs text; `to_text` turns ids
into text with the tokenizer when there is one, else into words (the count is then only an
estimate, and the server's reported usage wins).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

Prompt = str | list[int]
DEFAULT_VOCAB_SIZE = 4096  # without a tokenizer: ids below this are valid for nearly any model


@dataclasses.dataclass
class SampleRequest:
    prompt: Prompt  # the user prompt (completions: appended to `system`)
    prompt_len: int  # tokens; exact for ids, an estimate for text without a tokenizer
    output_len: int  # max_tokens
    system: Prompt | None = None  # shared prefix: prepended (completions) or a system message


class Tokenizer(Protocol):
    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


def load_tokenizer(path: str) -> Tokenizer:
    from stoker.common.tokenizer_files import load_tokenizer

    return load_tokenizer(path)


def length_range(length: int, ratio: float, minimum: int = 0) -> tuple[int, int]:
    """Inclusive [low, high] for lengths uniform around `length`, like vLLM's random dataset."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low = max(math.floor(length * (1 - ratio)), minimum)
    return low, max(math.ceil(length * (1 + ratio)), low)


class TokenSampler:
    """Draws random token ids from a vocabulary, skipping the tokenizer's special ids."""

    def __init__(self, rng: np.random.Generator, tokenizer: Tokenizer | None, vocab_size: int):
        self.rng = rng
        special = tokenizer.all_special_ids if tokenizer is not None else []
        self.ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), special)
        if self.ids.size == 0:
            raise ValueError("empty vocabulary")

    def __call__(self, n: int) -> list[int]:
        return self.ids[self.rng.integers(0, self.ids.size, size=n)].tolist()


def _lengths(
    rng: np.random.Generator, length: int, ratio: float, n: int, minimum: int
) -> list[int]:
    low, high = length_range(length, ratio, minimum)
    return rng.integers(low, high + 1, size=n).tolist()


def random_requests(
    sample: TokenSampler,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """`num` prompts of random ids; with `prefix_len`, every one shares the same random prefix."""
    in_lens = _lengths(sample.rng, input_len, range_ratio, num, minimum=0 if prefix_len else 1)
    out_lens = _lengths(sample.rng, output_len, range_ratio, num, minimum=1)
    prefix = sample(prefix_len) if prefix_len else None
    return [
        SampleRequest(sample(n_in), prefix_len + n_in, n_out, prefix)
        for n_in, n_out in zip(in_lens, out_lens)
    ]


def jsonl_requests(
    path: str | Path, num: int, default_output_len: int, count: Callable[[str], int]
) -> list[SampleRequest]:
    """The first `num` lines of a JSONL file of {"prompt": str | [int], "max_tokens"?: int}."""
    out: list[SampleRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(out) >= num:
                break
            if not line.strip():
                continue
            try:
                row: Any = json.loads(line)
                prompt = row["prompt"]
                max_tokens = int(row.get("max_tokens") or default_output_len)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{'prompt': ...}}: {e}") from e
            if isinstance(prompt, list):
                out.append(SampleRequest([int(t) for t in prompt], len(prompt), max_tokens))
            elif isinstance(prompt, str):
                out.append(SampleRequest(prompt, count(prompt), max_tokens))
            else:
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a string or a list of ids")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through back"
)
WORDS = _WORDS.split()


def to_text(ids: Prompt, tokenizer: Tokenizer | None) -> str:
    """Text for a chat message: decoded ids, or one word per id (deterministic) without one."""
    if isinstance(ids, str):
        return ids
    if tokenizer is not None:
        return tokenizer.decode(ids)
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(text.split())  # a rough estimate; the server's usage report replaces it
