"""What reaches a replica through the fleet's router: the client's bytes, every field of them.

A real smg 1.13 and the fleet's front (tools/fleet/front.py) over real HTTP, in front of a
capture backend that records what arrives and answers like a replica. Through the front every
body arrives byte for byte, and the replica's answer comes back byte for byte; smg alone, the
last test shows, does not carry them (docs/fleet.md, "What reaches the replicas").
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from stoker.tools.fleet.front import HINT_MAX_BYTES, HINT_MAX_IDS, routing_hint
from stoker.tools.fleet.plan import front_command, router_command
from tests.fleet.capture_backend import MODEL, CaptureBackend, free_port
from tests.fleet.fleet_procs import wait_until

_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": True,
        },
    }
]
_CALL = {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}  # fmt: skip

# Fields both endpoints take, each with values smg 1.13 alone loses or refuses where it has any.
COMMON: dict[str, dict] = {
    "response_format_json_object": {"response_format": {"type": "json_object"}},
    "response_format_json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": _SCHEMA, "strict": True},
        }
    },
    "structured_outputs_json": {"structured_outputs": {"json": _SCHEMA}},
    "structured_outputs_regex": {"structured_outputs": {"regex": "[a-z]+"}},
    "structured_outputs_choice": {"structured_outputs": {"choice": ["yes", "no"]}},
    "structured_outputs_grammar": {"structured_outputs": {"grammar": 'root ::= "a"'}},
    "metadata_store_service_tier_user": {
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "user": "u-1",
    },  # fmt: skip
    "top_k_0": {"top_k": 0},
    "top_k_5": {"top_k": 5},
    "min_p_int": {"min_p": 0},
    "repetition_penalty_int": {"repetition_penalty": 1},
    "stop_token_ids": {"stop_token_ids": [1, 2]},
    "ignore_eos_false": {"ignore_eos": False},
    "ignore_eos_true": {"ignore_eos": True},
    "skip_special_tokens_false": {"skip_special_tokens": False},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "nulls": {
        "top_k": None,
        "min_p": None,
        "stop_token_ids": None,
        "response_format": None,
        "metadata": None,
        "seed": None,
    },  # fmt: skip
    "floats_and_bias": {"temperature": 0.95, "top_p": 0.95, "logit_bias": {"11": -100}},
    "five_stop_strings": {"stop": ["a", "b", "c", "d", "e"]},
    "temperature_3": {"temperature": 3},
    "unknown_field": {"stoker_future_field": {"a": [1, 2]}},
    "stream": {"stream": True, "stream_options": {"include_usage": True}},
}
CHAT: dict[str, dict] = {
    "tools": {"tools": _TOOLS, "tool_choice": "auto", "parallel_tool_calls": False},
    "tool_choice_named": {
        "tools": _TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },  # fmt: skip
    "tool_choice_required": {"tools": _TOOLS, "tool_choice": "required"},
    "tool_call_and_tool_messages": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": _TOOLS,
    },
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "continue_final_message": {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "logprobs_token_ids": {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True},
}
COMPLETIONS: dict[str, dict] = {
    "prompt_token_ids": {"prompt": [1, 2, 3]},
    "prompt_token_id_batch": {"prompt": [[1, 2, 3], [4, 5]]},
    "prompt_string_batch": {"prompt": ["a", "b"]},
    "logprobs_echo": {"logprobs": 1, "echo": True},
    "logprobs_token_ids": {"logprobs": 2, "return_tokens_as_token_ids": True},
    "stream_token_ids": {"prompt": [1, 2, 3], "stream": True},
}


def _cases() -> list[tuple[str, str, dict]]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    out = [(f"chat-{k}", "/v1/chat/completions", {**chat, **v}) for k, v in (COMMON | CHAT).items()]
    out += [(f"cmpl-{k}", "/v1/completions", {**completion, **v}) for k, v in COMMON.items()]
    out += [(f"cmpl-{k}", "/v1/completions", {**completion, **v}) for k, v in COMPLETIONS.items()]
    return out


CASES = _cases()


@dataclass
class Router:
    backends: list[CaptureBackend]
    smg: subprocess.Popen
    front: subprocess.Popen
    smg_url: str
    url: str  # the front's

    def post(self, url: str, path: str, body: dict) -> tuple[bytes, httpx.Response]:
        raw = json.dumps(body).encode()
        headers = {"content-type": "application/json", "authorization": "Bearer k"}
        return raw, httpx.post(url + path, content=raw, headers=headers, timeout=30)


def _start(backends: int) -> Iterator[Router]:
    bes = [CaptureBackend(free_port()).start() for _ in range(backends)]
    smg_port, front_port = free_port(), free_port()
    args = argparse.Namespace(
        host="127.0.0.1", port=front_port, router_policy="cache_aware",
        router_metrics_port=free_port(), shutdown_timeout=1.0, api_key=None, router_args="",
    )  # fmt: skip
    smg_url = f"http://127.0.0.1:{smg_port}"
    smg_cmd = router_command(args, [b.url for b in bes], sys.executable, port=smg_port)
    smg = subprocess.Popen(smg_cmd, stdout=subprocess.DEVNULL, start_new_session=True)
    front = subprocess.Popen(front_command(args, smg_url), start_new_session=True)
    router = Router(bes, smg, front, smg_url, f"http://127.0.0.1:{front_port}")
    try:

        def ready() -> bool:
            try:
                listed = httpx.get(router.url + "/workers", timeout=1).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return len(listed) == backends and all(w["is_healthy"] for w in listed)

        wait_until(ready, 60, "smg and the front", smg)
        yield router
    finally:
        for proc in (front, smg):
            proc.send_signal(signal.SIGTERM)
        for proc in (front, smg):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for be in bes:
            be.stop()


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    yield from _start(backends=1)


@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[c[0] for c in CASES])
def test_every_field_reaches_the_replica_byte_for_byte(router, name, path, body):
    (backend,) = router.backends
    n = len(backend.generations())
    raw, response = router.post(router.url, path, body)
    (arrived,) = backend.generations()[n:]
    assert arrived.path == path
    assert arrived.body == raw  # byte for byte: not re-serialized, nothing added or dropped
    assert arrived.headers["authorization"] == "Bearer k"
    assert response.status_code == 200
    assert response.content == backend.answers[-1]  # and the replica's answer, unchanged


def test_smg_alone_rewrites_and_refuses_what_the_front_carries(router):
    """Why the front exists: smg parses these bodies into its own types. Should a new smg carry
    them as they are, this fails, and the front (and docs/fleet.md's table) can go."""
    (backend,) = router.backends
    completion = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
    _, response = router.post(router.smg_url, "/v1/completions", completion)
    assert response.status_code == 400 and "StringOrArray" in response.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": 0}
    _, response = router.post(router.smg_url, "/v1/chat/completions", chat)
    assert response.status_code == 400 and "top_k" in response.text
    n = len(backend.generations())
    body = {**completion, "prompt": "hi", "ignore_eos": False, "min_p": 0}
    _, response = router.post(router.smg_url, "/v1/completions", body)
    (arrived,) = backend.generations()[n:]
    got = arrived.json()
    assert "ignore_eos" not in got  # a false field dropped
    assert isinstance(got["min_p"], float)  # an integer made a float
    assert got["echo"] is False and got["stream"] is False  # defaults added


@pytest.fixture(scope="module")
def two_backends() -> Iterator[Router]:
    yield from _start(backends=2)


def test_front_retries_what_smg_could_not_deliver(two_backends):
    """smg streams a body it does not parse and so does not retry it; the front does, until
    smg's health checks have taken the dead replica out. No request fails."""
    r = two_backends
    r.backends[0].stop()
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
    start = time.monotonic()
    statuses = [r.post(r.url, "/v1/completions", body)[1].status_code for _ in range(20)]
    assert statuses == [200] * 20
    assert time.monotonic() - start < 30


def test_routing_hint_is_the_prompts_own_token_ids():
    assert routing_hint(b'{"prompt": [5, 6, 7]}') == "5,6,7"
    assert routing_hint(b'{"prompt": [[5, 6], [8]]}') == "5,6"  # a batch: its first prompt
    long = routing_hint(json.dumps({"prompt": list(range(10**6, 10**6 + 2000))}).encode())
    assert len(long.split(",")) == HINT_MAX_IDS and len(long) <= HINT_MAX_BYTES
    huge = routing_hint(json.dumps({"prompt": [2**32 - 1] * 600}).encode())
    assert len(huge) <= HINT_MAX_BYTES  # smg ignores a longer hint, then parses the body


def test_routing_hint_of_text_keeps_shared_prefixes():
    def ids(prompt: str) -> list[str]:
        return routing_hint(json.dumps({"prompt": prompt}).encode()).split(",")

    prefix = "You are a helpful assistant. " * 8
    a, b = ids(prefix + "What is 2+2?"), ids(prefix + "Name a colour.")
    shared = len(prefix) // 4
    assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
    hint = routing_hint(json.dumps({"prompt": "x" * 10_000}).encode())
    assert len(hint.split(",")) == HINT_MAX_IDS and len(hint) <= HINT_MAX_BYTES
    chat = [{"role": "system", "content": prefix}, {"role": "user", "content": "hi"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": prefix}]}]
    assert routing_hint(json.dumps({"messages": chat}).encode()).startswith(
        routing_hint(json.dumps({"messages": parts}).encode())[:100]
    )


def test_routing_hint_is_never_empty():
    # smg must route without reading the body even when the replica will refuse it.
    odd = [b"", b"not json", b"[1]", b"{}", b'{"prompt": []}', b'{"prompt": [-1]}', b"[" * 10**5]
    odd += [b'{"prompt": 5}', b'{"messages": "x"}', b'{"messages": [1, {"content": 2}]}']
    for body in odd:
        assert routing_hint(body)
