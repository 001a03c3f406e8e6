"""Hostile input: fuzzed from /openapi.json (schemathesis) and with bodies no schema describes
(hypothesis): never a 5xx, every error an OpenAI error body, and afterwards the server still
serves and every KV block is free."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

ROUTES = ["/v1/completions", "/v1/chat/completions"]
FAST = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the default suite runs the same cases every time
    database=None,
)
SLOW = settings(FAST, max_examples=400, derandomize=False)


def check_response(status: int, content_type: str, body: bytes) -> None:
    assert status < 500, (status, body[:500])
    if status >= 400:
        assert content_type.startswith("application/json"), body[:200]
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]


def check_healthy_and_free(server) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    s = server.wait_blocks_free()
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert server.state()["api_inflight"] == 0


def _operations(server) -> list:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz_schema(server, config: settings) -> None:
    """Every operation, with bodies that follow the schema and bodies that break it."""
    for operation in _operations(server):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # GETs take nothing to break

            @given(operation.as_strategy(generation_mode=mode))
            @config
            def run(case) -> None:
                response = case.call(base_url=server.url, timeout=60)
                content_type = response.headers.get("content-type", [""])[0]
                check_response(response.status_code, content_type, response.content)

            try:
                run()
            except Unsatisfiable:
                # A route whose schema admits every body (/stop_profile takes an optional
                # empty one) has no invalid input to generate: nothing to break.
                if mode is not GenerationMode.NEGATIVE:
                    raise


def test_schema_fuzz(fuzz_server):
    _fuzz_schema(fuzz_server, FAST)


@pytest.mark.slow
def test_schema_fuzz_long(fuzz_server):
    _fuzz_schema(fuzz_server, SLOW)


def test_openapi_lists_every_route(fuzz_server):
    doc = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=5).json()
    assert doc["openapi"].startswith("3.")
    for path in [*ROUTES, "/v1/models", "/health", "/metrics", "/debug/state"]:
        assert path in doc["paths"], path
    n = doc["components"]["schemas"]["CompletionRequest"]["properties"]["n"]
    assert n["maximum"] == 4  # --max-n


# -- bodies the schema cannot express ---------------------------------------------------------

BIG = [2**63, 2**64, -(2**63) - 1, 10**30, 2**31, -1]
_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(BIG),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json = st.recursive(
    _json_leaf,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "n", "max_tokens", "max_completion_tokens", "seed", "top_k", "top_p", "temperature",
    "logprobs", "top_logprobs", "stop", "stop_token_ids", "logit_bias", "prompt", "messages",
    "stream", "stream_options", "min_p", "presence_penalty", "repetition_penalty",
]  # fmt: skip


def _base(route: str) -> dict:
    if route.endswith("chat/completions"):
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"prompt": [5, 6, 7], "max_tokens": 4}


@st.composite
def hostile_bodies(draw) -> tuple[str, bytes]:
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["field", "raw", "nested", "nan", "utf8", "bigint"]))
    if kind == "field":  # one field set to anything, the rest valid
        body = _base(route)
        body[draw(st.sampled_from(FIELDS))] = draw(_json)
        return route, json.dumps(body).encode()
    if kind == "raw":
        return route, draw(st.binary(max_size=200))
    if kind == "nested":
        depth = draw(st.integers(10, 20_000))
        field = draw(st.sampled_from(["prompt", "logit_bias", "messages", "stop"]))
        text = json.dumps(_base(route))[:-1] + f', "{field}": ' + "[" * depth + "]" * depth + "}"
        return route, text.encode()
    if kind == "nan":
        token = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]))
        field = draw(st.sampled_from(["temperature", "top_p", "seed", "n", "max_tokens"]))
        return route, json.dumps(_base(route))[:-1].encode() + f', "{field}": {token}}}'.encode()
    if kind == "utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80"]))
        return route, b'{"prompt": "a' + bad + b'", "messages": [{"role": "user", "content": "x'
        +bad + b'"}]}'
    value = draw(st.sampled_from(BIG))  # "bigint": past every wire type
    field = draw(st.sampled_from(["n", "seed", "max_tokens", "top_k", "logprobs"]))
    if draw(st.booleans()):
        body = {**_base(route), field: value}
    else:
        key = draw(st.sampled_from(["stop_token_ids", "logit_bias", "prompt"]))
        body = {**_base(route), key: {str(value): 1} if key == "logit_bias" else [value]}
    return route, json.dumps(body).encode()


def _post_raw(server, route: str, body: bytes) -> None:
    r = httpx.post(
        f"{server.url}{route}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    check_response(r.status_code, r.headers.get("content-type", ""), r.content)


@given(hostile_bodies())
@settings(FAST, max_examples=120)
def test_hostile_bodies(fuzz_server, case):
    _post_raw(fuzz_server, *case)


@pytest.mark.slow
@given(hostile_bodies())
@SLOW
def test_hostile_bodies_long(fuzz_server, case):
    _post_raw(fuzz_server, *case)


@pytest.mark.parametrize(
    "field", ["n", "seed", "max_tokens", "top_k", "stop_token_ids", "logit_bias"]
)
def test_integers_past_int64_are_400(fuzz_server, field):
    """The issue's reproducer: `n: 2**63` allocated until the OOM killer came."""
    value = 9223372036854775808
    body = {"prompt": "hello", field: value}
    if field == "stop_token_ids":
        body[field] = [value]
    elif field == "logit_bias":
        body[field] = {str(value): 1}
    r = httpx.post(f"{fuzz_server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_limits_are_400(fuzz_server):
    url = f"{fuzz_server.url}/v1/completions"
    base = {"prompt": "hello", "max_tokens": 2}
    cases = {
        "n": {"n": 5},  # --max-n 4
        "stop": {"stop": ["x"] * 17},
        "stop_token_ids": {"stop_token_ids": [1] * 1025},
        "logit_bias": {"logit_bias": {str(i): 1 for i in range(1025)}},
    }
    for param, extra in cases.items():
        r = httpx.post(url, json={**base, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
    r = httpx.post(url, json={**base, "stop": ["x" * 1025]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}
    r = httpx.post(f"{fuzz_server.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_after_fuzzing_still_serving_and_blocks_free(fuzz_server):
    """Runs last in this module: whatever came before leaked nothing."""
    check_healthy_and_free(fuzz_server)
