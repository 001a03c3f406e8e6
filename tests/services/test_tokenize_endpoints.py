"""POST /tokenize and /detokenize on a real server: vLLM's shapes, the ids requests get (the
completion's usage.prompt_tokens counts the same ids), and OpenAI-style 400s."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoTokenizer.from_pretrained(str(model_path))


def test_tokenize_prompt_shape(http, server, hf):
    r = http.post("/tokenize", json={"prompt": "The capital of France is"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["tokens"] == hf("The capital of France is")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    r = http.post("/tokenize", json={"prompt": "ab cd", "return_token_strs": True})
    body = r.json()
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])
    assert http.post("/tokenize", json={"prompt": "ab", "model": server.model_name}).is_success


def test_tokenize_chat_uses_the_template(http, hf):
    body = http.post("/tokenize", json={"messages": CHAT}).json()
    want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert body["tokens"] == want["input_ids"]
    no_gen = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_gen["count"] < body["count"]
    assert body["tokens"][: no_gen["count"]] == no_gen["tokens"]
    # add_special_tokens on a chat: the rendered template encoded with the tokenizer's specials
    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    both = http.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()
    assert both["tokens"] == hf(rendered, add_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("prompt", ["The capital of France is", "héllo wörld 🚀, naïve"])
def test_tokenize_counts_what_a_completion_uses(http, server, prompt):
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    done = http.post(
        "/v1/completions", json={"model": server.model_name, "prompt": prompt, "max_tokens": 1}
    ).json()
    assert done["usage"]["prompt_tokens"] == len(ids)
    # and the ids themselves: sending them as the prompt gives the same greedy tokens
    by_ids = {"model": server.model_name, "max_tokens": 4, "temperature": 0}
    a = http.post("/v1/completions", json={**by_ids, "prompt": prompt}).json()
    b = http.post("/v1/completions", json={**by_ids, "prompt": ids}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_tokenize_counts_what_a_chat_uses(http, server):
    for gen in (True, False):
        ids = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": gen}).json()
        body = {"model": server.model_name, "messages": CHAT, "max_tokens": 1}
        done = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": gen})
        assert done.json()["usage"]["prompt_tokens"] == ids["count"]


def test_tokenize_counts_what_a_chat_with_tools_uses(http, server):
    """Tools, an earlier call and its result go through the template (docs/tool-calling.md)
    the same way for /tokenize as for a request."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    plain = http.post("/tokenize", json={"messages": messages}).json()["count"]
    ids = http.post("/tokenize", json={"messages": messages, "tools": [tool]}).json()
    assert ids["count"] > plain  # the generic format describes the tools in the system prompt
    body = {"model": server.model_name, "messages": messages, "tools": [tool], "max_tokens": 1}
    done = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert done.json()["usage"]["prompt_tokens"] == ids["count"]


def test_detokenize_round_trip(http, hf):
    text = "To be, or not to be 🚀"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": chat}).json()["prompt"] == hf.decode(chat)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", b"", None),
        ("/tokenize", b"{not json", None),
        ("/tokenize", b"{}", None),
        ("/tokenize", b'{"prompt": ""}', "prompt"),
        ("/tokenize", b'{"prompt": 5}', "prompt"),
        ("/tokenize", b'{"prompt": "a", "bogus": 1}', "bogus"),
        ("/tokenize", b'{"messages": []}', "messages"),
        ("/tokenize", b'{"messages": [{"role": "user"}], "prompt": "a"}', "prompt"),
        ("/detokenize", b'{"tokens": [-1]}', "tokens"),
        ("/detokenize", b'{"tokens": [99999]}', "tokens"),
        ("/detokenize", b'{"tokens": "abc"}', "tokens"),
        ("/detokenize", b"{}", None),
    ],
)
def test_bad_bodies_are_openai_400s(http, path, body, param):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_unknown_model_is_404(http):
    r = http.post("/tokenize", json={"prompt": "a", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_openapi_lists_the_routes(http):
    doc = http.get("/openapi.json").json()
    assert {"/tokenize", "/detokenize"} <= set(doc["paths"])
    assert "TokenizeChatRequest" in doc["components"]["schemas"]


def test_logprobs_as_token_ids(http, server):
    body = {"model": server.model_name, "prompt": "The capital", "max_tokens": 3, "logprobs": 2}
    body |= {"temperature": 0, "return_tokens_as_token_ids": True}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert len(ids) == 3 and all(f"token_id:{i}" in top for i, top in zip(ids, lp["top_logprobs"]))
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    plain = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False})
    assert plain.json()["choices"][0]["text"] == text
