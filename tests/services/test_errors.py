"""Bad input gets its 4xx with an OpenAI error body; the server stays up and leaks no blocks."""

from __future__ import annotations

import httpx
import openai
import pytest

GOOD = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOO_LONG = list(range(3, 503)) * 2  # 1000 tokens; the server runs with max_model_len 512

# (path, body, expected status, expected `param` or None when any)
CASES = [
    ("completions", b"{not json", 400, None),
    ("completions", b"", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {**GOOD, "max_tokens": "4"}, 400, "max_tokens"),
    ("completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**GOOD, "n": True}, 400, "n"),
    ("completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [1.5, 2]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [999999]}, 400, "prompt"),
    ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {**GOOD, "prompt": TOO_LONG}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": TOO_LONG, "stream": True}, 400, "prompt"),
    ("completions", {**GOOD, "n": 0}, 400, "n"),
    ("completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("completions", {**GOOD, "stop": [1, 2]}, 400, "stop"),
    ("completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("completions", {**GOOD, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": [5]}, 400, "logit_bias"),
    ("completions", {**GOOD, "model": "no-such-model"}, 404, "model"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, "messages"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {**CHAT, "max_completion_tokens": -3}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "stream": True, "max_tokens": 100000}, 400, "max_tokens"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]},
        400,
        None,
    ),
]


def _check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
def test_bad_request(server, path, body, status, param):
    url = f"{server.base_url}/{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    err = _check_error(r, status, param)
    if status == 404:
        assert err["code"] == "model_not_found"
    if param == "frobnicate":
        assert "frobnicate" in err["message"]


def test_body_too_large(server):
    body = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    r = httpx.post(f"{server.base_url}/completions", content=body, timeout=30)
    _check_error(r, 413, None)


def test_wrong_method_and_path(server):
    _check_error(httpx.get(f"{server.base_url}/completions", timeout=5), 405, None)
    _check_error(httpx.post(f"{server.base_url}/nowhere", json={}, timeout=5), 404, None)
    _check_error(httpx.delete(f"{server.url}/health", timeout=5), 405, None)


def test_openai_client_raises_typed_errors(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_name, prompt="hi", max_tokens=0)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=3)


def test_still_serves_and_no_leak_after_errors(server):
    for case in CASES[:5]:  # a few more bad ones right before, for good measure
        path, body, *_ = case
        if isinstance(body, bytes):
            httpx.post(f"{server.base_url}/{path}", content=body, timeout=30)
        else:
            httpx.post(f"{server.base_url}/{path}", json=body, timeout=30)
    r = httpx.post(f"{server.base_url}/completions", json=GOOD, timeout=30)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    state = server.wait_idle(1.0)
    assert state["num_running"] == 0 and state["num_waiting"] == 0
    assert state["num_free_blocks"] == state["num_total_blocks"]
