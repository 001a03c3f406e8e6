"""End-to-end text: stop strings that span tokens, and UTF-8 characters split across tokens.

The model is random, so prompts and stop strings are chosen from its actual greedy output (by
the offline LLM on the same folder); that makes the cases deterministic and guaranteed to occur.
"""

from __future__ import annotations

import codecs
import random

import httpx
import msgspec
import pytest

from stoker.common.sampling_params import SamplingParams
from stoker.services.api.tokens import TokenStrings

MAX_TOKENS = 32


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def greedy(llm):
    prompts = _prompts(48)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return list(zip(prompts, llm.generate(prompts, params)))


@pytest.fixture(scope="module")
def strings(model_path) -> TokenStrings:
    return TokenStrings(model_path)


def _complete(server, prompt, stream: bool, **body) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) via raw HTTP; SSE parsed by hand."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0} | body
    if not stream:
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()
        return (
            out["choices"][0]["text"],
            out["choices"][0]["finish_reason"],
            out["usage"]["completion_tokens"],
        )
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, finish, usage = "", None, None
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = msgspec.json.decode(line[6:])
            for c in chunk["choices"]:
                text += c["text"]
                finish = c["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    return text, finish, usage["completion_tokens"]


def _stop_across_tokens(strings: TokenStrings, token_ids: list[int]) -> tuple[int, str] | None:
    """(token index k, stop string) spanning the boundary after token k: both neighbours are
    printable ASCII, so character offsets are unambiguous."""
    pieces = [strings.bytes(t) for t in token_ids]
    for k in range(4, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if all(p and p.isascii() and p.decode().isprintable() for p in (a, b)):
            return k, (a.decode()[-3:] + b.decode()[:3])
    return None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_split_across_tokens(server, greedy, strings, stream, include_stop):
    case = next((p, o, s) for p, o in greedy if (s := _stop_across_tokens(strings, o.token_ids)))
    prompt, ref, (k, stop) = case
    cut = ref.text.find(stop)
    assert cut >= 0
    expected = ref.text[: cut + len(stop) if include_stop else cut]
    # Far more tokens allowed than the stop needs: only the stop-string abort ends it quickly.
    body = {"stop": [stop, "never-occurs-xyz"], "ignore_eos": True, "max_tokens": 300}
    if include_stop:
        body["include_stop_str_in_output"] = True
    text, finish, n_tokens = _complete(server, prompt, stream, **body)
    assert text == expected
    assert finish == "stop"
    assert n_tokens <= k + 2 < MAX_TOKENS  # generation ended at the stop, not at max_tokens
    state = server.wait_idle(1.0)
    assert state["num_running"] == 0 and state["num_free_blocks"] == state["num_total_blocks"]


def _split_char(strings: TokenStrings, token_ids: list[int]) -> str | None:
    """A real (not U+FFFD) multi-byte character whose bytes span two or more tokens."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = False
    for t in token_ids:
        out = dec.decode(strings.bytes(t))
        if pending and out and out[0] != "\ufffd" and ord(out[0]) > 127:
            return out[0]
        pending = bool(dec.getstate()[0])
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_multibyte_character_split_across_tokens(server, greedy, strings, stream):
    prompt, ref, char = next(
        (p, o, c) for p, o in greedy if (c := _split_char(strings, o.token_ids))
    )
    text, finish, n_tokens = _complete(server, prompt, stream, ignore_eos=True)
    assert char in text
    assert text == ref.text
    assert (finish, n_tokens) == ("length", MAX_TOKENS)


def test_multibyte_text_prompt(server, llm):
    prompt = "héllo wörld — 日本語のテキスト, emoji 🚀🔥"
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    for stream in (False, True):
        text, finish, n_tokens = _complete(server, prompt, stream)
        assert (text, finish, n_tokens) == (ref.text, ref.finish_reason, len(ref.token_ids))
