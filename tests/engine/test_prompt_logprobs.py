"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log_softmax over the
prompt's logits in float32: whole prompts and chunked ones (on the decode-row and the prefill-
span layouts), prompts whose prefix is in the prefix cache, preemption, overlap, top-k and
k=0; requests that do not ask are unchanged beside one that does; and no KV block leaks."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from stoker.common.messages import TokenLogprobs
from stoker.common.model_config import ModelConfig
from stoker.services.engine import LLM, SamplingParams
from stoker.services.scheduler.publish import Owner, token_batches
from stoker.services.scheduler.request import Request, RequestUpdate
from stoker.services.worker.loader import load_model
from stoker.services.worker.step_inputs import Chunk, build_step_inputs
from tests.factory import make_model

TOL = 1e-4
Reference = list[tuple[float, list[int], list[float]] | None]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prompt_lp") / "model", "llama")


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _reference(hf, prompt: list[int], k: int) -> Reference:
    """transformers' entries: token j given tokens 0..j-1, from the logits at position j-1."""
    with torch.inference_mode():
        lp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    out: Reference = [None]
    for j in range(1, len(prompt)):
        top = lp[j - 1].topk(k)
        out.append((lp[j - 1, prompt[j]].item(), top.indices.tolist(), top.values.tolist()))
    return out


def _check(got: list[TokenLogprobs | None] | None, want: Reference) -> None:
    assert got is not None and len(got) == len(want)
    assert got[0] is None
    for j, (entry, ref) in enumerate(zip(got[1:], want[1:]), start=1):
        assert entry is not None and ref is not None
        logprob, top_ids, top_logprobs = ref
        assert abs(entry.logprob - logprob) <= TOL, f"prompt token {j}"
        assert entry.top_ids == top_ids, f"prompt token {j}"
        assert max((abs(a - b) for a, b in zip(entry.top_logprobs, top_logprobs)), default=0) <= TOL


def _llm(model_path, **options) -> LLM:
    return LLM(model_path, **({"num_kv_blocks": 128, "max_model_len": 256} | options))


def _no_leaks(llm: LLM) -> None:
    blocks = llm.engine.block_manager
    blocks.check_invariants()
    assert blocks.num_free_blocks() == blocks.num_blocks, "KV blocks leaked"
    assert not llm.engine.scheduler._prompt_logprobs, "prompt logprobs left undelivered"


def _asking(k: int, **more) -> SamplingParams:
    options = dict(temperature=0.0, max_tokens=4, ignore_eos=True) | more
    return SamplingParams(prompt_logprobs=k, **options)


def test_a_short_prompt(model_path, hf):
    prompt = _prompt(1, 9)
    llm = _llm(model_path)
    [out] = llm.generate([prompt], _asking(3))
    _check(out.prompt_logprobs, _reference(hf, prompt, 3))
    _no_leaks(llm)


def test_no_prompt_logprobs_unless_asked(model_path):
    llm = _llm(model_path)
    [out] = llm.generate([_prompt(1, 9)], SamplingParams(max_tokens=2))
    assert out.prompt_logprobs is None
    _no_leaks(llm)


# 7: chunks laid out as decode rows (up to MAX_DECODE_CHUNK tokens); 24: as prefill spans, whose
# last layer keeps only some rows on the CPU (StepInputs.last_layer_meta).
@pytest.mark.parametrize("chunk", [7, 24])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_chunked_prompt(model_path, hf, chunk, overlap):
    prompt = _prompt(2, 83)
    llm = _llm(model_path, prefill_chunk_tokens=chunk, overlap=overlap)
    [out] = llm.generate([prompt], _asking(5))
    _check(out.prompt_logprobs, _reference(hf, prompt, 5))
    _no_leaks(llm)


def test_a_prompt_whose_prefix_is_cached(model_path, hf):
    """The asking request computes its whole prompt despite the cached prefix, and still fills
    the cache for the requests after it."""
    prefix = _prompt(3, 48)
    llm = _llm(model_path, block_size=16)
    llm.generate([prefix + [7, 8]], SamplingParams(max_tokens=2))  # caches the prefix's blocks
    hits = llm.engine.scheduler.prefix_hits
    prompt = prefix + _prompt(4, 21)
    [out] = llm.generate([prompt], _asking(2))
    assert llm.engine.scheduler.prefix_hits == hits, "it took prefix-cache hits"
    _check(out.prompt_logprobs, _reference(hf, prompt, 2))
    llm.generate([prompt + [9]], SamplingParams(max_tokens=2))
    assert llm.engine.scheduler.prefix_hits >= hits + 64, "its blocks were not cached"
    _no_leaks(llm)


def test_k_zero_and_a_one_token_prompt(model_path, hf):
    prompt = _prompt(5, 12)
    llm = _llm(model_path)
    out, single = llm.generate([prompt, [42]], _asking(0))
    want = _reference(hf, prompt, 0)
    _check(out.prompt_logprobs, want)
    assert all(e is None or e.top_ids == [] == e.top_logprobs for e in out.prompt_logprobs)
    assert single.prompt_logprobs == [None]
    _no_leaks(llm)


def test_a_request_that_finishes_with_its_first_token(model_path, hf):
    prompt = _prompt(6, 20)
    llm = _llm(model_path, prefill_chunk_tokens=8)
    [out] = llm.generate([prompt], _asking(1, max_tokens=1))
    _check(out.prompt_logprobs, _reference(hf, prompt, 1))
    _no_leaks(llm)


def test_mixed_batches_leave_the_others_unchanged(model_path, hf):
    """One request asks (with sample logprobs too), the others do not: every output equals the
    batch where none asks, token for token and logprob for logprob."""
    prompts = [_prompt(10 + i, n) for i, n in enumerate([5, 40, 17, 1, 64, 30])]
    plain = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2 if i else None)
        for i in range(len(prompts))
    ]
    asking = list(plain)
    asking[4] = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=4
    )
    options = dict(prefill_chunk_tokens=20, max_num_batched_tokens=48)
    want = _llm(model_path, **options).generate(prompts, plain)
    llm = _llm(model_path, **options)
    got = llm.generate(prompts, asking)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) <= TOL
        if i != 4:
            assert g.prompt_logprobs is None
    _check(got[4].prompt_logprobs, _reference(hf, prompts[4], 4))
    _no_leaks(llm)


def test_preemption_recomputes_the_prompt_entries(model_path, hf):
    """Six blocks of 16 tokens for requests that grow past them: preempted prompts compute
    their entries again, and the recomputed ones replace those gathered before."""
    prompts = [_prompt(20 + i, n) for i, n in enumerate([30, 45, 20, 38])]
    params = _asking(3, max_tokens=40)
    llm = _llm(
        model_path, num_kv_blocks=6, max_num_seqs=4, max_model_len=96, prefill_chunk_tokens=8
    )
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for prompt, out in zip(prompts, outs):
        _check(out.prompt_logprobs, _reference(hf, prompt, 3))
    _no_leaks(llm)


def test_n_choices_share_the_prompt_entries(model_path, hf):
    prompt = _prompt(7, 26)
    llm = _llm(model_path)
    [out] = llm.generate([prompt], _asking(2, n=3, temperature=1.0, seed=3))
    assert len(out.outputs) == 3
    _check(out.prompt_logprobs, _reference(hf, prompt, 2))
    _no_leaks(llm)


def test_the_null_model_reports_a_uniform_distribution(model_path):
    llm = _llm(model_path, null_model=True)
    [out] = llm.generate([_prompt(8, 10)], _asking(2))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 10
    vocab = llm.engine.model_config.vocab_size
    for entry in out.prompt_logprobs[1:]:
        assert entry is not None and abs(entry.logprob + torch.log(torch.tensor(vocab))) < 1e-5
        assert len(entry.top_ids) == 2
    _no_leaks(llm)


def test_the_first_update_carries_them_as_an_item():
    """publish.token_batches: the update with prompt logprobs is an item that carries them."""
    request = Request("r", [5, 6, 7], SamplingParams(prompt_logprobs=0), 8, (2,))
    entries: list[TokenLogprobs | None] = [None, TokenLogprobs(-1.0, [], []), None]
    entries[2] = TokenLogprobs(-2.0, [], [])
    owners = {"r": Owner(b"tok")}
    first = token_batches([RequestUpdate("r", [9], request, prompt_logprobs=entries)], owners)
    [item] = first[b"tok"].items
    assert item.prompt_logprobs == entries and not first[b"tok"].steady_req_ids
    later = token_batches([RequestUpdate("r", [10], request)], owners)
    assert later[b"tok"].steady_req_ids == ["r"] and not later[b"tok"].items


def test_the_trimmed_last_layer_keeps_the_prompt_rows(model_path):
    """build_step_inputs: a chunk with prompt rows keeps all its rows in the last layer, and
    last_layer_prompt_rows pick the same hidden states as the untrimmed forward's prompt_rows."""
    cfg = ModelConfig.from_folder(model_path)
    model = load_model(model_path, torch.float32, "cpu", 256)
    bs, cpu = 16, torch.device("cpu")
    chunks = [
        Chunk(_prompt(30, 1), 20, [0, 1], 1),  # a decode
        Chunk(_prompt(31, 40), 0, [2, 3, 4], 0, num_prompt_rows=40),  # a first chunk
        Chunk(_prompt(32, 30), 0, [5, 6], 1),  # a whole prompt that does not ask
        Chunk(_prompt(33, 25), 16, [7, 8, 9], 1, num_prompt_rows=24),  # a last chunk
        Chunk(_prompt(34, 5), 3, [10], 1, num_prompt_rows=4),  # a short last chunk
    ]
    shape = (11, bs, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    history = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))]
    picked = []
    for trim in (False, True):
        kv = [(k.clone(), v.clone()) for k, v in history * cfg.num_layers]
        inputs = build_step_inputs(chunks, bs, cpu, trim_last_layer=trim)
        assert inputs.prompt_rows is not None and len(inputs.prompt_rows) == 40 + 24 + 4
        last = inputs.last_layer_meta
        assert (last is not None) == trim
        hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta, last)
        rows = inputs.last_layer_prompt_rows if trim else inputs.prompt_rows
        sampled = inputs.last_layer_sample_rows if trim else inputs.sample_rows
        picked.append((hidden[rows], hidden[sampled]))
    for full, trimmed in zip(*picked):
        torch.testing.assert_close(trimmed, full, rtol=1e-5, atol=1e-5)
