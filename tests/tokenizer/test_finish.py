"""The finish rule both front ends share: a stop string that completes in the step where the
engine ends the request for length is reported as "stop" (vLLM), offline and in the server."""

from __future__ import annotations

import pytest

from stoker.common.addresses import Addresses
from stoker.common.finish import finish_reason, text_token_ids
from stoker.common.messages import RequestTokens, TokenBatch, TokenizeRequest, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.services.tokenizer.service import TokenizerService
from tests.factory import make_model


def test_rule():
    assert finish_reason("length", stop_string_matched=True) == "stop"
    assert finish_reason("length", stop_string_matched=False) == "length"
    assert finish_reason(None, stop_string_matched=True) == "stop"
    assert finish_reason(None, stop_string_matched=False) is None
    assert text_token_ids([4, 2], "stop", frozenset({2}), False) == [4]
    assert text_token_ids([4, 2], "stop", frozenset({2}), True) == [4, 2]
    assert text_token_ids([4, 2], "length", frozenset({2}), False) == [4, 2]


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> TokenizerService:
    path = make_model(tmp_path_factory.mktemp("finish") / "model", "llama")
    addresses = Addresses.in_run_dir(tmp_path_factory.mktemp("unused"))
    return TokenizerService(path, "tok-finish", addresses, max_model_len=64)


def test_server_stop_string_in_the_length_step_is_stop(svc):
    ids = svc.tokenizer.encode(" hello world")
    params = SamplingParams(max_tokens=len(ids), stop=["world"])
    svc.admit(TokenizeRequest("r", params, prompt_token_ids=pack_ids([5, 6])))
    # The scheduler ends it for length in the very step whose token completes "world".
    item = RequestTokens("r", pack_ids(ids), finish_reason="length")
    out, stopped = svc.detokenize(TokenBatch([item]))
    deltas = out.items
    assert deltas[0].finish_reason == "stop" and deltas[0].text == " hello "
    assert not stopped  # the scheduler already finished it: nothing to abort
    assert "r" not in svc.requests
