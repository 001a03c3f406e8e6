"""Structured outputs in the engine (services/worker/grammar.py): every token the grammar
allows, greedy output equal to Hugging Face transformers' argmax over the same masked logits,
and the same output with speculation (n-gram drafts, a draft model) as without.

The reference runs the transformers model on the folder in float32 and masks its logits with a
fresh llguidance matcher built from the grammar the engine compiled, one token at a time."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoModelForCausalLM

from stoker.common.model_config import ModelConfig
from stoker.common.sampling_params import StructuredOutput
from stoker.kernels.token_mask import apply_token_bitmask_reference
from stoker.services.engine import LLM, SamplingParams
from tests.factory import make_model
from tests.spec.eagle_heads import make_head

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # compact: a random model ends in few tokens
}
CONSTRAINTS = {
    "json": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", r"(ab|c[de]){2,4}f"),
    "choice": StructuredOutput("choice", json.dumps(["alpha beta", "gamma", "delta epsilon"])),
    "lark": StructuredOutput("lark", 'start: "x" ("y" | "z")* "."'),
}
OPTIONS = dict(num_kv_blocks=256, block_size=4, max_model_len=256)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("grammar") / "model", "llama")


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), **OPTIONS)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 20))] for _ in range(count)]


def _matcher(llm: LLM, params: SamplingParams):
    vocab = ModelConfig.from_folder(llm.engine.config.model).vocab_size
    ll_tok = llguidance.hf.from_tokenizer(
        llm.tokenizer, n_vocab=vocab, eos_token=llm.tokenizer.eos_token_id
    )
    return llguidance.LLMatcher(ll_tok, llm._compiled(params).structured.grammar)


def _check_allowed(llm: LLM, params: SamplingParams, tokens: list[int]) -> None:
    matcher = _matcher(llm, params)
    eos = llm.tokenizer.eos_token_id
    body = tokens[:-1] if tokens and tokens[-1] == eos else tokens
    assert matcher.consume_tokens(body), matcher.get_error()
    if tokens and tokens[-1] == eos:
        assert matcher.is_accepting()


def _reference(model_path, llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    matcher = _matcher(llm, params)
    vocab = model.config.vocab_size
    words = (vocab + 31) // 32
    ids, out = list(prompt), []
    eos = llm.tokenizer.eos_token_id
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()[None]
            # (Not llguidance.torch: it imports triton, which the kernel tests set up first.)
            mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            apply_token_bitmask_reference(logits, mask[:words][None], torch.tensor([0]))
            token = int(logits.argmax())
            out.append(token)
            if token == eos:
                break
            assert matcher.consume_token(token)
            ids.append(token)
    return out


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_equals_transformers_masked_argmax(model_path, llm, kind):
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=CONSTRAINTS[kind])
    prompts = _prompts(1, 3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == _reference(model_path, llm, prompt, params)
        _check_allowed(llm, params, tokens)
    if kind == "json":
        for out in outs:
            if out.outputs[0].finish_reason == "stop":
                value = json.loads(out.outputs[0].text)
                assert set(value) == {"ok", "color", "n"} and value["color"] in (
                    "red",
                    "green",
                    "blue",
                )


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_sampling_stays_in_the_grammar(llm, kind):
    params = [
        SamplingParams(max_tokens=40, temperature=t, top_p=p, seed=s, structured=CONSTRAINTS[kind])
        for t, p, s in ((1.0, 1.0, 1), (0.8, 0.9, 2), (1.3, 1.0, None), (0.7, 1.0, 4))
    ]
    outs = llm.generate(_prompts(2, 4), params, use_tqdm=False)
    for p, out in zip(params, outs):
        _check_allowed(llm, p, out.outputs[0].token_ids)
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks() == blocks.num_blocks


def test_mixed_batch_with_unconstrained_rows(llm):
    """Structured and plain requests share steps; the plain ones are as they are alone."""
    prompts = _prompts(3, 6)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    structured = SamplingParams(max_tokens=40, temperature=0.0, structured=CONSTRAINTS["regex"])
    mixed = llm.generate(prompts, [plain, structured] * 3, use_tqdm=False)
    alone = llm.generate(prompts[0::2], plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]
    for out in mixed[1::2]:
        _check_allowed(llm, structured, out.outputs[0].token_ids)


@pytest.mark.parametrize("speculative", ["ngram", "draft", "eagle"])
def test_speculation_keeps_greedy_structured_output(model_path, llm, speculative, tmp_path):
    prompts = _prompts(5, 4)
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured=CONSTRAINTS[k])
        for k in ("json", "regex", "lark", "choice")
    ]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    options = dict(OPTIONS, speculative=speculative, num_speculative_tokens=3)
    if speculative == "draft":
        options["speculative_model"] = str(model_path)  # itself: every allowed draft accepted
    if speculative == "eagle":  # a random-init head: drafts the grammar mostly rejects
        options["speculative"] = "draft"
        options["speculative_model"] = str(make_head(model_path, tmp_path / "eagle"))
    spec = LLM(str(model_path), **options)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    blocks = spec.engine.block_manager
    assert blocks.num_free_blocks() == blocks.num_blocks


def test_invalid_constraint_is_a_value_error(llm):
    bad = SamplingParams(
        structured=StructuredOutput("json_schema", '{"type": "object", "not": {}}')
    )
    with pytest.raises(ValueError, match="not"):
        llm.generate([[5, 6, 7]], bad, use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7]], SamplingParams(structured=StructuredOutput("regex", "(")))


def test_fast_forward_keeps_greedy_output(model_path, monkeypatch):
    """Forced tokens proposed as drafts (scheduler) and verified under the masks (worker): the
    same tokens as without (benchmarks/structured_outputs.py counts the passes saved)."""
    from stoker.services.scheduler.scheduler import Scheduler

    prompts = _prompts(7, 4)
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=CONSTRAINTS["json"])
    off = LLM(str(model_path), **OPTIONS, grammar_fast_forward=False)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    proposed: list[int] = []
    original = Scheduler._forced_drafts

    def spy(self, request, budget):
        drafts = original(self, request, budget)
        proposed.append(len(drafts))
        return drafts

    monkeypatch.setattr(Scheduler, "_forced_drafts", spy)
    on = LLM(str(model_path), **OPTIONS)
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert sum(proposed) > 0  # `{"ok":` and friends are forced
    blocks = on.engine.block_manager
    assert blocks.num_free_blocks() == blocks.num_blocks
