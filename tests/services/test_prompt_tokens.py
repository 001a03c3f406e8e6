"""stoker.common.prompt_tokens (what /tokenize runs) gives the same ids as the tokenizer process's
TokenizerService.tokenize (what requests get), for plain prompts and chat templates."""

from __future__ import annotations

import pytest

from stoker.common.addresses import Addresses
from stoker.common.messages import ChatMessage, TokenizeRequest
from stoker.common.prompt_tokens import prompt_token_ids
from stoker.common.sampling_params import SamplingParams
from stoker.common.tokenizer_files import load_tokenizer
from stoker.services.tokenizer.service import TokenizerService

PROMPTS = ["The capital of France is", "héllo wörld 🚀", " leading space", "a\n\nb"]
CHATS = [
    [ChatMessage("user", "What is the capital of France?")],
    [
        ChatMessage("system", "Be terse."),
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello"),
    ],
]


@pytest.fixture(scope="module")
def service(model_path):
    return TokenizerService(model_path, "t", Addresses.from_env())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_ids_are_the_request_path_ids(service, prompt):
    req = TokenizeRequest("r", SamplingParams(), prompt=prompt)
    assert prompt_token_ids(service.tokenizer, prompt=prompt) == service.tokenize(req)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_ids_are_the_request_path_ids(service, messages, gen):
    req = TokenizeRequest("r", SamplingParams(), messages=messages, add_generation_prompt=gen)
    dicts = [{"role": m.role, "content": m.content} for m in messages]
    ids = prompt_token_ids(service.tokenizer, messages=dicts, add_generation_prompt=gen)
    assert ids == service.tokenize(req)


def test_special_tokens_switches(model_path):
    tok = load_tokenizer(model_path)
    msgs = [{"role": "user", "content": "hi"}]
    templated = prompt_token_ids(tok, messages=msgs)
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.decode(templated) == rendered
    with_specials = prompt_token_ids(tok, messages=msgs, add_special_tokens=True)
    assert with_specials == tok.encode(rendered, add_special_tokens=True)
    assert prompt_token_ids(tok, prompt="x y", add_special_tokens=False) == tok.encode(
        "x y", add_special_tokens=False
    )
    with pytest.raises(ValueError, match="empty"):
        prompt_token_ids(tok, prompt="")
