"""How the scheduler service hands a step's tokens to tokenizers: one TokenBatch per
tokenizer, steady rows (one token of an announced request that goes on, nothing else to say)
as columns, every other row as a RequestTokens item with its figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.common.addresses import Addresses
from stoker.common.config import EngineConfig
from stoker.common.ipc import encoder, tokenizer_inbound_decoder
from stoker.common.messages import GenerateRequest, TokenBatch, TokenLogprobs, WorkerReady, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.common.shutdown import destroy_context_within
from stoker.services.scheduler.publish import token_batches
from stoker.services.scheduler.request import FinishReason
from stoker.services.scheduler.scheduler import RequestUpdate
from stoker.services.scheduler.service import SchedulerService
from tests.factory import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("publish") / "tiny", "llama")


def test_steady_rows_travel_as_columns_and_the_rest_as_items(model, tmp_path):
    service = SchedulerService(
        EngineConfig(model=str(model), null_model=True), Addresses.in_run_dir(tmp_path / "run")
    )
    try:
        service._start(WorkerReady(num_blocks=64, block_size=16, max_model_len=64, vocab_size=256))
        owners = {"a1": b"tok-a", "a2": b"tok-a", "lp": b"tok-a", "spec": b"tok-a", "b1": b"tok-b"}
        for req_id, owner in owners.items():
            params = SamplingParams(max_tokens=8, logprobs=1 if req_id == "lp" else None)
            service._add(owner, GenerateRequest(req_id, pack_ids([5, 6, 7]), params))
        requests = service.scheduler.requests
        logprobs = [TokenLogprobs(-0.5, [9], [-0.5])]

        def step(tokens: dict[str, list[int]], finished: str = "") -> dict[bytes, TokenBatch]:
            updates = [
                RequestUpdate(
                    req_id,
                    ids,
                    requests[req_id],
                    FinishReason.LENGTH if req_id == finished else None,
                    logprobs * len(ids) if req_id == "lp" else None,
                )
                for req_id, ids in tokens.items()
            ]
            sent = token_batches(updates, service.owners)
            # Through the wire, as the tokenizer gets them.
            return {r: tokenizer_inbound_decoder.decode(encoder.encode(b)) for r, b in sent.items()}

        # First tokens announce their requests: items with the prompt's figures.
        first = step({r: [10] for r in owners})
        assert sorted(first) == [b"tok-a", b"tok-b"]
        assert all(not b.steady_req_ids for b in first.values())
        assert [i.req_id for i in first[b"tok-a"].items] == ["a1", "a2", "lp", "spec"]
        assert all(i.num_prompt_tokens == 3 for b in first.values() for i in b.items)

        requests["spec"].num_draft_tokens, requests["spec"].num_accepted_tokens = 4, 3
        second = step({"a1": [11], "a2": [12], "lp": [13], "spec": [14, 15], "b1": [16]})
        a, b = second[b"tok-a"], second[b"tok-b"]
        assert (a.steady_req_ids, a.steady_token_ids) == (["a1", "a2"], pack_ids([11, 12]))
        assert (b.steady_req_ids, b.steady_token_ids, b.items) == (["b1"], pack_ids([16]), [])
        lp, spec = a.items
        assert (lp.req_id, lp.token_ids, lp.logprobs) == ("lp", pack_ids([13]), logprobs)
        assert (spec.req_id, spec.token_ids) == ("spec", pack_ids([14, 15]))
        assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (4, 3)
        assert all(i.num_prompt_tokens == 0 for i in a.items)  # announced once only

        # A finish is an item; a one-token speculating request still carries its stats.
        third = step({"a1": [21], "a2": [22], "spec": [23]}, finished="a2")
        a = third[b"tok-a"]
        assert (a.steady_req_ids, a.steady_token_ids) == (["a1"], pack_ids([21]))
        assert [(i.req_id, i.finish_reason, i.num_draft_tokens) for i in a.items] == [
            ("a2", "length", 0),
            ("spec", None, 4),
        ]
        assert "a2" not in service.owners
    finally:
        destroy_context_within(service.ctx, linger_ms=0, seconds=10.0)
