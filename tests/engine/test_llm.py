"""The offline API: outputs, every sampling path end to end, bad input, and no KV leaks."""

from __future__ import annotations

import pytest

from stoker.services.engine import LLM, SamplingParams
from tests.factory import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("llm") / "model", "llama")
    return LLM(path, num_kv_blocks=128, max_model_len=256)


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    blocks = llm.engine.block_manager
    blocks.check_invariants()
    assert blocks.num_free_blocks() == blocks.num_blocks
    assert not llm.engine.has_unfinished()


def test_outputs_in_order_with_text(llm):
    prompts = ["The quick brown fox", [5, 6, 7], "Once upon a time"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outs] == ["The quick brown fox", None, "Once upon a time"]
    for out in outs:
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert outs[1].prompt_token_ids == [5, 6, 7]


def test_completion_metrics_order_arrival_first_token_and_finish(llm):
    """Timestamps let a caller separate prefill from decode (benchmarks/speculative.py does)."""
    outs = llm.generate(["a b c", "d e f g"], [GREEDY, GREEDY])
    for completion in (o.outputs[0] for o in outs):
        m = completion.metrics
        assert m.first_token_time is not None and m.finished_time is not None
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        assert m.decode_seconds == m.finished_time - m.first_token_time
    one = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert one.outputs[0].metrics.decode_seconds == 0.0  # one token: all prefill


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(["hello world"], GREEDY)[0].token_ids
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True, seed=3)
    assert llm.generate(["hello world"], top1)[0].token_ids == greedy


def test_seed_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1234)
    alone = llm.generate(["To be, or not"], seeded)[0].token_ids
    others = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        ["abc", "To be, or not", "a much longer prompt than the others here"],
        [others, seeded, others],
    )
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=99)
    assert llm.generate(["To be, or not"], other_seed)[0].token_ids != alone


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, max_tokens=10, ignore_eos=True),
        SamplingParams(
            temperature=0.0,
            presence_penalty=1.5,
            frequency_penalty=1.0,
            repetition_penalty=1.3,
            max_tokens=10,
            ignore_eos=True,
        ),
    ],
    ids=["top_p", "top_k_min_p", "penalties"],
)
def test_sampling_paths_run(llm, params):
    out = llm.generate(["The quick brown fox"], params)[0]
    assert len(out.token_ids) == 10


def test_penalties_change_greedy_output(llm):
    # The tiny random model repeats itself under greedy decoding; penalties must break that.
    plain = llm.generate([[7, 7, 7, 7]], SamplingParams(temperature=0, max_tokens=24))[0]
    penalised = llm.generate(
        [[7, 7, 7, 7]], SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0)
    )[0]
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))


def test_logprobs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    out = llm.generate(["hello"], params)[0]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert len(lp.top_ids) == 3 and lp.top_ids[0] == token  # greedy picks the argmax
        assert lp.logprob == pytest.approx(lp.top_logprobs[0])
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_n_completions(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)
    out = llm.generate(["hello"], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_token_ids_and_stop_strings(llm):
    ref = llm.generate(["Friends, Romans"], GREEDY)[0]
    stop_token = ref.token_ids[5]
    first = ref.token_ids.index(stop_token)
    out = llm.generate(
        ["Friends, Romans"],
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]

    stop = ref.text[len(ref.text) // 2 :][:3]
    if stop.strip():
        out = llm.generate(
            ["Friends, Romans"], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
        )[0]
        assert out.finish_reason == "stop"
        assert out.text == ref.text[: ref.text.index(stop)]


def test_stops_at_context_length(llm):
    out = llm.generate([[5] * 250], SamplingParams(temperature=0.0, max_tokens=None))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", GREEDY, "empty"),
        ([], GREEDY, "empty"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ([5] * 300, GREEDY, "context length"),
        ([5] * 250, SamplingParams(max_tokens=10), "context length"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(temperature=-1.0), "temperature"),
        ([100000], GREEDY, "token ids"),
    ],
)
def test_bad_input_raises_and_engine_keeps_working(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], params)
    assert len(llm.generate(["still works"], GREEDY)[0].token_ids) == 12


def test_stop_string_in_the_length_step_is_stop(llm):
    """max_tokens and a stop string end the request in the same step: "stop", as the server
    reports it (common/finish.py)."""
    ref = llm.generate(["Friends, Romans"], GREEDY)[0]
    text = ref.text.rstrip()
    # The shortest tail of the text that occurs nowhere earlier completes with the last token.
    tails = [text[i:] for i in range(len(text) - 1, -1, -1)]
    stop = next(t for t in tails if t.strip() and text.find(t) == len(text) - len(t))
    assert llm.tokenizer.decode(ref.token_ids[:-1]).find(stop) < 0
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = llm.generate(["Friends, Romans"], params)[0]
    assert out.token_ids == ref.token_ids
    assert out.finish_reason == "stop" and out.text == text[: len(text) - len(stop)]


def test_n_choices_compute_the_prompt_once(llm):
    """The n choices share the prompt's full blocks: the first computes the prompt, the others
    wait one step and take its blocks as prefix-cache hits, computing only the partial tail.
    Each choice equals the same request run on its own with its seed (seed + index)."""
    prompt = list(range(400, 450))  # 50 tokens, used by no other test: 3 full blocks and 2
    n, max_tokens = 4, 6
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=9)
    runner, computed = llm.engine.runner, []
    execute = runner.execute

    def counting(plan):
        computed.append(
            sum(r.num_scheduled_tokens for r in plan.new_requests)
            + sum(plan.running.num_scheduled_tokens)
        )
        return execute(plan)

    runner.execute = counting
    try:
        out = llm.generate([prompt], params)[0]
    finally:
        runner.execute = execute
    tail = len(prompt) - 48
    assert sum(computed) == len(prompt) + (n - 1) * tail + n * (max_tokens - 1)
    for i, choice in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=9 + i)
        assert choice.token_ids == llm.generate([prompt], single)[0].token_ids
