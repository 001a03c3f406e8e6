"""The official openai client, sync and async, against the real server: greedy output equals the
offline LLM's, streamed deltas add up to the whole text, usage / finish_reason / logprobs."""

from __future__ import annotations

import asyncio

import openai
import pytest

from stoker.common.sampling_params import SamplingParams

PROMPT_IDS = [74, 71, 469, 300, 12, 99]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo!"}]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _greedy(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw))[0]


def _chat_ids(llm) -> list[int]:
    ids = llm.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def _check_usage(usage, prompt_len: int, completion: int) -> None:
    assert usage.prompt_tokens == prompt_len
    assert usage.completion_tokens == completion
    assert usage.total_tokens == prompt_len + completion


def test_completion_matches_offline(server, client, llm):
    ref = _greedy(llm, PROMPT_IDS)
    out = client.completions.create(
        model=server.model_name, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == server.model_name
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    _check_usage(out.usage, len(PROMPT_IDS), len(ref.token_ids))

    stream = client.completions.create(
        model=server.model_name,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == []
    _check_usage(chunks[-1].usage, len(PROMPT_IDS), len(ref.token_ids))


def test_text_prompt_matches_offline(server, client, llm):
    prompt = "Once upon a time there was"
    ref = _greedy(llm, prompt)
    out = client.completions.create(
        model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_matches_offline(server, client, llm):
    ids = _chat_ids(llm)
    ref = _greedy(llm, ids, ignore_eos=True)
    kw = dict(model=server.model_name, messages=MESSAGES, temperature=0)
    out = client.chat.completions.create(
        **kw, max_completion_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == "length"
    _check_usage(out.usage, len(ids), MAX_TOKENS)

    stream = client.chat.completions.create(
        **kw,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    _check_usage(chunks[-1].usage, len(ids), MAX_TOKENS)


def test_async_client_completion_and_chat(server, llm):
    ref = _greedy(llm, PROMPT_IDS)
    chat_ref = _greedy(llm, _chat_ids(llm))

    async def run() -> tuple[str, str, str]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client:
            whole, streamed, chat = await asyncio.gather(
                client.completions.create(
                    model=server.model_name, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0
                ),
                client.completions.create(
                    model=server.model_name,
                    prompt=PROMPT_IDS,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                ),
                client.chat.completions.create(
                    model=server.model_name,
                    messages=MESSAGES,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                ),
            )
            text = "".join([c.choices[0].text async for c in streamed])
            chat_text = "".join([c.choices[0].delta.content or "" async for c in chat])
            return whole.choices[0].text, text, chat_text

    whole, streamed, chat = asyncio.run(run())
    assert whole == streamed == ref.text
    assert chat == chat_ref.text


def test_completion_logprobs(server, client, llm):
    ref = _greedy(llm, PROMPT_IDS, logprobs=3, ignore_eos=True)
    out = client.completions.create(
        model=server.model_name,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert len(lp.text_offset) == MAX_TOKENS and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for i, (chosen, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        assert chosen == pytest.approx(ref.logprobs[i].logprob, abs=1e-3)
        assert 1 <= len(top) <= 4 and lp.tokens[i] in top
        assert chosen >= max(top.values()) - 1e-5  # greedy picks the best


def test_chat_logprobs(server, client):
    out = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    # Raw token bytes add up to the text (byte-level BPE, no eos in a length finish).
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode("utf-8", errors="replace") == out.choices[0].message.content

    stream = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_n_fans_out_with_seeds(server, client, llm):
    params = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = llm.generate([PROMPT_IDS], params)[0]
    kw = dict(
        model=server.model_name,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        seed=7,
        n=2,
        extra_body={"ignore_eos": True},
    )
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [o.text for o in ref.outputs]
    _check_usage(out.usage, len(PROMPT_IDS), 2 * MAX_TOKENS)

    texts = ["", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [o.text for o in ref.outputs]


def test_logit_bias_bans_the_greedy_token_as_offline(server, client, llm):
    """logit_bias travels from the client to the sampler: banning the greedy first token gives
    what the offline engine gives with the same bias."""
    first = _greedy(llm, PROMPT_IDS).token_ids[0]
    bias = {first: -100.0}
    ref = _greedy(llm, PROMPT_IDS, logit_bias=bias)
    assert ref.token_ids[0] != first and first not in ref.token_ids
    out = client.completions.create(
        model=server.model_name,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logit_bias={str(first): -100},
    )
    assert out.choices[0].text == ref.text
