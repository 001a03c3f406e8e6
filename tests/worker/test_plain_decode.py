"""The runner's plain decode step (services/worker/plain_decode.py: one token for each running
request, laid out from arrays instead of per-request Scheduled and Chunk objects) against the
general path it short-cuts. Each case generates twice on the same weights and seed, once with
the plain path refused, and compares every token, logprob and top id; the plain path must have
served most of the steps, and no KV block may be left held."""

from __future__ import annotations

import random

import pytest

from stoker.services.engine import LLM, SamplingParams
from stoker.services.worker import model_runner
from tests.factory import make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("plain") / "model", "llama")


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 30))] for _ in range(count)]


def _generate(path, prompts, params, plain: bool, **options):
    """Outputs, and how many steps took the plain path and how many did not."""
    options = dict(num_kv_blocks=256, block_size=4, max_model_len=128) | options
    llm = LLM(str(path), **options)
    refuse = model_runner.steady_states
    taken = {"plain": 0, "general": 0}

    def counted(plan, requests, proposer):
        states = refuse(plan, requests, proposer) if plain else None
        if plan.new_requests or plan.running.req_ids:
            taken["plain" if states is not None else "general"] += 1
        return states

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "steady_states", counted)
        outs = llm.generate(prompts, params, use_tqdm=False)
    blocks = llm.engine.block_manager
    blocks.check_invariants()
    assert blocks.num_free_blocks() == blocks.num_blocks
    return outs, taken


def _same(got, want) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        if w.logprobs is None:
            assert g.logprobs is None
            continue
        assert [lp.logprob for lp in g.logprobs] == [lp.logprob for lp in w.logprobs]
        assert [lp.top_ids for lp in g.logprobs] == [lp.top_ids for lp in w.logprobs]


def _mixed_params(count: int) -> list[SamplingParams]:
    """Every sampling option the plain path hands to the sampler, lengths spread so requests
    finish on different steps and new ones join mid-run."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=7),
        dict(temperature=1.0, top_k=20, top_p=0.9),
        dict(temperature=0.7, min_p=0.05, seed=3),
        dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=0.9, repetition_penalty=1.3, seed=11),
        dict(temperature=0.0, logit_bias={5: 4.0, 9: -100.0}),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.6, logprobs=2, seed=5),
    ]
    return [
        SamplingParams(max_tokens=4 + (5 * i) % 17, ignore_eos=True, **kinds[i % len(kinds)])
        for i in range(count)
    ]


def test_every_sampling_option_matches_the_general_path(model_path):
    prompts = _prompts(1, 18)
    params = _mixed_params(18)
    want, general = _generate(model_path, prompts, params, plain=False, max_num_seqs=6)
    got, taken = _generate(model_path, prompts, params, plain=True, max_num_seqs=6)
    _same(got, want)
    assert general["plain"] == 0
    assert taken["plain"] > taken["general"] > 0, taken


def test_greedy_batches_match_the_general_path(model_path):
    """All greedy: the rows want only the argmax, as on a bfloat16 model's greedy head."""
    prompts = _prompts(2, 12)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 12
    want, _ = _generate(model_path, prompts, params, plain=False)
    got, taken = _generate(model_path, prompts, params, plain=True)
    _same(got, want)
    assert taken["plain"] > taken["general"], taken


def test_preemption_and_resumption_match_the_general_path(model_path):
    """A pool too small for every request at once: preempted requests come back as new ones
    (a general step), then decode on the plain path again."""
    prompts = _prompts(3, 8)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 8
    options = dict(num_kv_blocks=40, max_num_seqs=8)
    want, _ = _generate(model_path, prompts, params, plain=False, **options)
    got, taken = _generate(model_path, prompts, params, plain=True, **options)
    _same(got, want)
    assert taken["plain"] > 0, taken


def test_the_null_model_matches_the_general_path(model_path):
    """No forward: the host pipeline's fixed next token, from arrays."""
    prompts = _prompts(4, 10)
    params = [SamplingParams(max_tokens=9 + i, ignore_eos=True) for i in range(10)]
    want, _ = _generate(model_path, prompts, params, plain=False, null_model=True)
    got, taken = _generate(model_path, prompts, params, plain=True, null_model=True)
    _same(got, want)
    assert taken["plain"] > taken["general"], taken


def test_steps_where_adaptive_speculation_is_off_take_the_plain_path(model_path):
    """n-gram speculation configured, but past speculative_max_batch decoding requests the
    scheduler proposes nothing (empty draft lists): those steps are plain decodes."""
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8] * 3 for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 6
    options = dict(speculative="ngram", speculative_max_batch=2)
    want, _ = _generate(model_path, prompts, params, plain=False, **options)
    got, taken = _generate(model_path, prompts, params, plain=True, **options)
    _same(got, want)
    assert taken["plain"] > taken["general"], taken
