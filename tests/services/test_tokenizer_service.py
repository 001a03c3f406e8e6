"""The tokenizer service's sans-IO core: admission (tokenize + validate) and detokenization."""

from __future__ import annotations

import msgspec
import pytest

from stoker.common.addresses import Addresses
from stoker.common.messages import (
    ChatMessage,
    RequestTokens,
    TextDelta,
    TokenBatch,
    TokenizeRequest,
    pack_ids,
    unpack_ids,
)
from stoker.common.sampling_params import SamplingParams
from stoker.services.tokenizer.service import TokenizerService

EOS = 2


@pytest.fixture(scope="module")
def svc(model_path, tmp_path_factory) -> TokenizerService:
    addresses = Addresses.in_run_dir(tmp_path_factory.mktemp("unused"))
    return TokenizerService(model_path, "tok-test", addresses, max_model_len=64)


def _detokenize(svc: TokenizerService, *items: RequestTokens) -> tuple[list[TextDelta], list[str]]:
    """Items in, items out: the batch's steady columns stay empty."""
    out, stopped = svc.detokenize(TokenBatch(list(items)))
    assert not out.steady_req_ids
    return out.items, stopped


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
    deltas, stopped = _detokenize(svc, RequestTokens("e", pack_ids(hello), num_prompt_tokens=2))
    assert deltas[0].text == "hello" and deltas[0].num_prompt_tokens == 2 and not stopped
    deltas, stopped = _detokenize(svc, RequestTokens("e", pack_ids([EOS]), finish_reason="stop"))
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
        deltas, stopped = _detokenize(svc, RequestTokens("s", pack_ids([t])))
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
    deltas, _ = _detokenize(svc, item)
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
            out, stopped = _detokenize(svc, item)
            assert not stopped
            deltas += [msgspec.structs.asdict(d) | {"req_id": ""} for d in out]
        runs.append(deltas)
        assert req_id not in svc.requests
    assert runs[0] == runs[1]
    assert "".join(d["text"] for d in runs[0]) == svc.tokenizer.decode(ids)
    assert runs[0][0]["prompt_token_ids"] == pack_ids([5, 6, 7])


def test_steady_rows_stream_the_text_items_stream(svc):
    """Steady columns give the text that items give. A request with stop strings among them
    takes the general path and still stops; rows of requests unknown here (or finished by a
    stop string) are dropped, and the token column follows the rows kept."""
    ids = svc.tokenizer.encode("naïve café 東京 🙂 done")
    names = ("col", "item", "stop")
    for name in names:
        params = SamplingParams(max_tokens=60, stop=["東"] if name == "stop" else [])
        svc.admit(TokenizeRequest(name, params, prompt_token_ids=pack_ids([5, 6])))
    first = [RequestTokens(name, pack_ids(ids[:1]), num_prompt_tokens=2) for name in names]
    out, _ = svc.detokenize(TokenBatch(first))
    texts = {d.req_id: [d.text] for d in out.items}
    stops: list[str] = []
    for t in ids[1:]:
        steady = ["gone", "col", "stop"]
        batch = TokenBatch([RequestTokens("item", pack_ids([t]))], steady, pack_ids([t] * 3))
        out, stopped = svc.detokenize(batch)
        stops += stopped
        assert out.steady_req_ids == ["col"]
        assert out.steady_token_ids == pack_ids([t])
        assert len(out.steady_texts) == 1
        texts["col"].append(out.steady_texts[0])
        for d in out.items:
            assert d.req_id in ("item", "stop")
            texts[d.req_id].append(d.text)
    assert "".join(texts["col"]) == "".join(texts["item"]) == svc.tokenizer.decode(ids)
    assert "".join(texts["stop"]) == "naïve café "
    assert stops == ["stop"] and "stop" not in svc.requests


@pytest.mark.parametrize("path", ["steady", "item", "general"])
def test_a_request_whose_text_fails_to_decode_ends_alone(svc, path):
    """A decoder error ends that request with an error delta and an abort upstream, on each
    path a token can take; the rest of the batch is detokenized as usual."""
    for name in ("bad", "good"):
        stop = ["zzz"] if path == "general" else []  # stop strings take the general path
        params = SamplingParams(max_tokens=8, stop=stop)
        svc.admit(TokenizeRequest(name, params, prompt_token_ids=pack_ids([5, 6])))

    def broken(*_args: object) -> str:
        raise RuntimeError("decoder exploded")

    svc.requests["bad"].detok._step = broken
    t = svc.tokenizer.encode("hello")[0]
    if path == "steady":
        batch = TokenBatch([], ["bad", "good"], pack_ids([t, t]))
    else:
        batch = TokenBatch([RequestTokens(name, pack_ids([t])) for name in ("bad", "good")])
    out, stopped = svc.detokenize(batch)
    bad = [d for d in out.items if d.req_id == "bad"]
    assert len(bad) == 1 and bad[0].finish_reason == "abort"
    assert bad[0].error == "decoder exploded"
    assert stopped == ["bad"] and "bad" not in svc.requests
    good = out.steady_texts if path == "steady" else [d.text for d in out.items if d is not bad[0]]
    assert good == [svc.tokenizer.decode([t])]
    assert out.steady_req_ids == (["good"] if path == "steady" else [])
    del svc.requests["good"]
