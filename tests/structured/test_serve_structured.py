"""Structured outputs over real processes (docs/structured-outputs.md): a malformed schema and
a compile past its time limit each get a 4xx while other streams go on, greedy structured
output is the same with n-gram speculation as without, the compile cache and the per-request
figures reach /metrics, and every KV block is free at idle."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from tests.factory import make_model
from tests.reliability.serve import Served

pytestmark = pytest.mark.timeout(300)

FLAGS = ("--num-kv-blocks", "256", "--block-size", "16", "--max-model-len", "512")
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
PROMPTS = [[5, 17, 99, 230, 41], [300, 2, 8], [77, 77, 77, 77, 12, 9, 400]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("serve-structured") / "model", "llama")


def _serve(model_path, tmp_path_factory, *flags: str) -> Served:
    run = tmp_path_factory.mktemp("run")
    return Served(model_path, run, run / "serve.log", *FLAGS, *flags)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    s = _serve(model_path, tmp_path_factory)
    yield s
    s.stop()


def _complete(url: str, body: dict) -> httpx.Response:
    body = {"temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _stream_tokens(url: str, prompt: list[int], max_tokens: int) -> int:
    """A plain streamed completion; the number of tokens its usage chunk reports."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body |= {"temperature": 0, "stream_options": {"include_usage": True}}
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


def _while_streaming(url: str, action):
    """Run `action` while three plain streams run; the streams must finish whole."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream_tokens, url, p, 150) for p in PROMPTS]
        result = action()
        assert [s.result() for s in streams] == [150] * 3
    return result


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "pattern": "("}, "regex"),
        ({"$ref": "#/$defs/missing"}, "missing"),
    ],
)
def test_a_bad_schema_is_a_400_while_streams_go_on(server, schema, named):
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "structured_outputs": {"json": schema}}
    r = _while_streaming(server.url, lambda: _complete(server.url, body))
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]
    assert (
        server.wait_blocks_free()["num_free_blocks"]
        == server.wait_blocks_free()["num_total_blocks"]
    )


def test_structured_outputs_are_valid_and_the_cache_answers_repeats(server):
    body = {"prompt": PROMPTS[1], "max_tokens": 60, "structured_outputs": {"json": SCHEMA}}
    first, again = _complete(server.url, body), _complete(server.url, body)
    for r in (first, again):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert set(json.loads(choice["text"])) == {"ok", "color"}
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'stoker:grammar_compiles_total{cache="hit"}' in metrics
    assert "stoker:grammar_mask_seconds_count" in metrics
    assert "stoker:step_grammar_mask_seconds_count" in metrics
    state = server.wait_blocks_free()
    assert state["num_free_blocks"] == state["num_total_blocks"]


def test_constraints_compose_with_n_seeds_logprobs_stop_and_max_tokens(server):
    """Sampled choices under one constraint: each stays in the regex, a seed repeats its
    choices, logprobs come per token, a stop string cuts the text, max_tokens gives length."""
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "n": 3,
        "logprobs": 2,
        "structured_outputs": {"regex": "[ab]{2,30}"},
    }
    first, again = _complete(server.url, body).json(), _complete(server.url, body).json()
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    for choice in first["choices"]:
        assert set(choice["text"]) <= {"a", "b"} and choice["finish_reason"] in ("stop", "length")
        assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["token_logprobs"])
    cut = _complete(server.url, {**body, "n": 1, "stop": ["b"], "logprobs": None}).json()
    assert "b" not in cut["choices"][0]["text"]
    short = {"prompt": PROMPTS[1], "max_tokens": 3, "structured_outputs": {"json": SCHEMA}}
    choice = _complete(server.url, short).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"].startswith("{")


def test_a_compile_past_its_limit_is_a_400_while_streams_go_on(model_path, tmp_path_factory):
    slow = _serve(model_path, tmp_path_factory, "--grammar-compile-timeout", "0.000001")
    try:
        body = {"prompt": PROMPTS[2], "max_tokens": 8, "structured_outputs": {"regex": "[a-f]{4}"}}
        r = _while_streaming(slow.url, lambda: _complete(slow.url, body))
        assert r.status_code == 400, r.text
        assert "longer than" in r.json()["error"]["message"]
        state = slow.wait_blocks_free()
        assert state["num_free_blocks"] == state["num_total_blocks"]
    finally:
        slow.stop()


def test_greedy_structured_output_is_the_same_with_ngram_speculation(
    server, model_path, tmp_path_factory
):
    bodies = [
        {"prompt": PROMPTS[0], "max_tokens": 60, "structured_outputs": {"json": SCHEMA}},
        {"prompt": PROMPTS[2], "max_tokens": 40, "structured_outputs": {"regex": "(ab|cd){3,9}"}},
        {"prompt": PROMPTS[1], "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}},
    ]
    want = [_complete(server.url, b).json()["choices"][0]["text"] for b in bodies]
    spec = _serve(model_path, tmp_path_factory, "--speculative", "ngram")
    try:
        got = [_complete(spec.url, b).json()["choices"][0]["text"] for b in bodies]
        state = spec.wait_blocks_free()
        assert state["num_free_blocks"] == state["num_total_blocks"]
    finally:
        spec.stop()
    assert got == want
