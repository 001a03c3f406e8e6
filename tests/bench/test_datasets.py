"""Prompt generators and request bodies of `stoker bench serve` (no server needed)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from stoker.tools.bench import datasets
from stoker.tools.bench.client import build_payload, chunk_text
from stoker.tools.bench.datasets import SampleRequest, TokenSampler

REPO = Path(__file__).resolve().parents[2]


class FakeTokenizer:
    vocab_size = 10
    all_special_ids = [0, 1, 2]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3] * len(text)  # one token per character

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def sampler(
    seed: int = 0, tokenizer: FakeTokenizer | None = None, vocab: int = 1000
) -> TokenSampler:
    return TokenSampler(np.random.default_rng(seed), tokenizer, vocab)


def test_length_range_matches_vllm() -> None:
    assert datasets.length_range(100, 0.0) == (100, 100)
    assert datasets.length_range(100, 0.5) == (50, 150)
    assert datasets.length_range(10, 0.25) == (7, 13)  # floor / ceil
    assert datasets.length_range(1, 0.9, minimum=1) == (1, 2)
    with pytest.raises(ValueError, match="range-ratio"):
        datasets.length_range(100, 1.0)


def test_random_exact_lengths() -> None:
    reqs = datasets.random_requests(sampler(), 20, input_len=32, output_len=8)
    assert len(reqs) == 20
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 32
        assert r.output_len == 8 and r.system is None
        assert all(0 <= t < 1000 for t in r.prompt)
    assert len({tuple(r.prompt) for r in reqs}) == 20


def test_random_range_ratio() -> None:
    reqs = datasets.random_requests(sampler(), 200, 100, 40, range_ratio=0.25)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 75 and max(ins) <= 125 and len(set(ins)) > 10
    assert min(outs) >= 30 and max(outs) <= 50 and len(set(outs)) > 5
    assert all(len(r.prompt) == r.prompt_len for r in reqs)


def test_random_is_seeded() -> None:
    a = datasets.random_requests(sampler(seed=7), 5, 16, 4, range_ratio=0.5)
    b = datasets.random_requests(sampler(seed=7), 5, 16, 4, range_ratio=0.5)
    c = datasets.random_requests(sampler(seed=8), 5, 16, 4, range_ratio=0.5)
    assert a == b and a != c


def test_sampler_skips_special_ids() -> None:
    ids = sampler(tokenizer=FakeTokenizer(), vocab=10)(500)
    assert set(ids) == set(range(3, 10))


def test_shared_prefix_identical_across_prompts() -> None:
    reqs = datasets.random_requests(sampler(), 6, 16, 4, range_ratio=0.5, prefix_len=64)
    prefix = reqs[0].system
    assert isinstance(prefix, list) and len(prefix) == 64
    assert all(r.system == prefix for r in reqs)
    assert all(r.prompt_len == 64 + len(r.prompt) for r in reqs)
    assert len({tuple(r.prompt) for r in reqs}) == 6  # suffixes differ


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "hello there world", "max_tokens": 5},
        {"prompt": "no max tokens"},
        {"prompt": [5, 6, 7, 8]},
        {"prompt": "beyond --num-prompts"},
    ]
    path.write_text(
        "\n".join(json.dumps(r) for r in rows[:2])
        + "\n\n"
        + "\n".join(json.dumps(r) for r in rows[2:])
    )
    reqs = datasets.jsonl_requests(path, 3, default_output_len=11, count=lambda s: len(s.split()))
    assert reqs == [
        SampleRequest("hello there world", 3, 5),
        SampleRequest("no max tokens", 3, 11),
        SampleRequest([5, 6, 7, 8], 4, 11),
    ]


@pytest.mark.parametrize("line", ['{"text": "x"}', "not json", '{"prompt": 3}'])
def test_jsonl_bad_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        datasets.jsonl_requests(path, 10, 8, count=len)


def test_to_text_and_count() -> None:
    assert datasets.to_text("already text", None) == "already text"
    words = datasets.to_text([0, 1, 2, 0], None)
    assert len(words.split()) == 4 and words == datasets.to_text([0, 1, 2, 0], None)
    tok = FakeTokenizer()
    assert datasets.to_text([0, 1, 2], tok) == "abc"
    assert datasets.count_tokens("abcd", tok) == 4
    assert datasets.count_tokens("two words", None) == 2


def test_build_payload_completions_and_chat() -> None:
    r = SampleRequest([5, 6], 5, 7, system=[1, 2, 3])
    to_text = lambda p: datasets.to_text(p, FakeTokenizer())
    body = build_payload(
        r, model="m", chat=False, temperature=0.0, ignore_eos=True, to_text=to_text
    )
    assert body["prompt"] == [1, 2, 3, 5, 6] and body["max_tokens"] == 7
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    chat = build_payload(
        r,
        model="m",
        chat=True,
        temperature=0.5,
        ignore_eos=False,
        to_text=to_text,
        extra={"top_k": 1},
    )
    assert chat["messages"] == [
        {"role": "system", "content": "bcd"},
        {"role": "user", "content": "fg"},
    ]
    assert chat["max_completion_tokens"] == 7 and chat["top_k"] == 1
    assert "ignore_eos" not in chat and "prompt" not in chat


def test_chunk_text() -> None:
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"content": "cd"}}]}) == "cd"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


@pytest.mark.skipif(
    not (REPO / "models" / "stoker-tiny" / "tokenizer.json").exists(), reason="no bundled model"
)
def test_real_tokenizer_prompts() -> None:
    tok = datasets.load_tokenizer(str(REPO / "models" / "stoker-tiny"))
    s = TokenSampler(np.random.default_rng(0), tok, tok.vocab_size)
    ids = s(300)
    assert not set(ids) & set(tok.all_special_ids)
    assert isinstance(datasets.to_text(ids, tok), str)
