"""The tokenizer service's sans-IO core: admission (tokenize + validate) and detokenization."""

from __future__ import annotations

import msgspec
import pytest

from common.addresses import Addresses
from common.messages import (
    ChatMessage,
    RequestTokens,
    TokenBatch,
    TokenizeRequest,
    pack_ids,
    unpack_ids,
)
from common.sampling_params import SamplingParams
from services.tokenizer.service import TokenizerService

EOS = 2


@pytest.fixture(scope="module")
def svc(model_path, tmp_path_factory) -> TokenizerService:
    addresses = Addresses.in_run_dir(tmp_path_factory.mktemp("unused"))
    return TokenizerService(model_path, "tok-test", addresses, max_model_len=64)


def _batch(*items: RequestTokens) -> TokenBatch:
    return TokenBatch(list(items))


def test_admit_prompt_ids_and_chat(svc):
    params = SamplingParams(max_tokens=4)
    text = svc.admit(TokenizeRequest("a", params, prompt="hello world"))
    assert unpack_ids(text.prompt_token_ids) == svc.tokenizer.encode("hello world")
    ids = svc.admit(TokenizeRequest("b", params, prompt_token_ids=pack_ids([5, 6, 7])))
    assert unpack_ids(ids.prompt_token_ids) == [5, 6, 7]
    chat = svc.admit(TokenizeRequest("c", params, messages=[ChatMessage("user", "hi")]))
    expected = svc.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    assert unpack_ids(chat.prompt_token_ids) == list(expected)
    assert {"a", "b", "c"} <= set(svc.requests)


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        (dict(prompt=""), "empty"),
        (dict(prompt_token_ids=pack_ids(range(3, 80))), "context length"),
        (dict(prompt_token_ids=pack_ids([4096])), "prompt token ids"),
    ],
)
def test_admit_rejects(svc, request_kw, message):
    out = svc.admit(TokenizeRequest("bad", SamplingParams(max_tokens=4), **request_kw))
    assert out.error is not None and message in out.error
    assert "bad" not in svc.requests


def test_eos_text_dropped_and_state_freed(svc):
    svc.admit(TokenizeRequest("e", SamplingParams(max_tokens=8), prompt_token_ids=pack_ids([5, 6])))
    hello = svc.tokenizer.encode("hello")
    deltas, stopped = svc.detokenize(
        _batch(RequestTokens("e", pack_ids(hello), num_prompt_tokens=2))
    )
    assert deltas[0].text == "hello" and deltas[0].num_prompt_tokens == 2 and not stopped
    deltas, stopped = svc.detokenize(
        _batch(RequestTokens("e", pack_ids([EOS]), finish_reason="stop"))
    )
    assert (deltas[0].text, deltas[0].finish_reason, deltas[0].token_ids) == (
        "",
        "stop",
        pack_ids([EOS]),
    )
    assert "e" not in svc.requests and not stopped


def test_stop_string_aborts_upstream_and_drops_late_tokens(svc):
    params = SamplingParams(max_tokens=30, stop=["wor"])
    svc.admit(TokenizeRequest("s", params, prompt_token_ids=pack_ids([5, 6])))
    ids = svc.tokenizer.encode("hello world again")
    texts, stops = [], []
    for t in ids:
        deltas, stopped = svc.detokenize(_batch(RequestTokens("s", pack_ids([t]))))
        texts += [d.text for d in deltas]
        stops += stopped
        if deltas and deltas[0].finish_reason:
            assert deltas[0].finish_reason == "stop"
    assert "".join(texts) == "hello "
    assert stops == ["s"]  # told the scheduler exactly once; later tokens were ignored
    assert "s" not in svc.requests


def test_scheduler_rejection_becomes_error(svc):
    svc.admit(TokenizeRequest("r", SamplingParams(max_tokens=4), prompt_token_ids=pack_ids([5])))
    item = RequestTokens("r", b"", finish_reason="abort", error="needs too many KV blocks")
    deltas, _ = svc.detokenize(_batch(item))
    assert deltas[0].error == "needs too many KV blocks"
    assert "r" not in svc.requests


def test_one_token_fast_path_gives_the_general_paths_deltas(svc):
    """Running requests without stop strings take a shorter path for one-token items; its
    deltas must be the general path's, field for field, through multi-byte characters split
    across tokens, speculation's several-token items, prompt ids on the first delta and an eos
    finish."""
    text = "naïve café 東京 🙂 done"
    ids = svc.tokenizer.encode(text)
    # One token per step, with a three-token (speculative) step in the middle.
    steps = [ids[:1], *[[t] for t in ids[1:5]], ids[5:8], *[[t] for t in ids[8:]], [EOS]]
    runs: list[list] = []
    for fast in (True, False):
        req_id = f"fast-{fast}"
        request = TokenizeRequest(
            req_id, SamplingParams(max_tokens=60), prompt_token_ids=pack_ids([5, 6, 7]),
            return_prompt_ids=True,
        )  # fmt: skip
        svc.admit(request)
        svc.requests[req_id].detok.plain = fast  # False: every item on the general path
        deltas = []
        for i, step in enumerate(steps):
            item = RequestTokens(req_id, pack_ids(step), num_draft_tokens=i, num_accepted_tokens=i)
            if i == 0:
                item.num_prompt_tokens, item.num_cached_tokens, item.queue_s = 3, 1, 0.25
            if i == len(steps) - 1:
                item.finish_reason = "stop"
            out, stopped = svc.detokenize(_batch(item))
            assert not stopped
            deltas += [msgspec.structs.asdict(d) | {"req_id": ""} for d in out]
        runs.append(deltas)
        assert req_id not in svc.requests
    assert runs[0] == runs[1]
    assert "".join(d["text"] for d in runs[0]) == svc.tokenizer.decode(ids)
    assert runs[0][0]["prompt_token_ids"] == pack_ids([5, 6, 7])
