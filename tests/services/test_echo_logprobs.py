"""echo and prompt logprobs over the real server (services/api/prompt_logprob_render.py): echo's
text is prompt + completion for text and token-id prompts, its logprobs equal the offline
engine's prompt logprobs then output logprobs, max_tokens 0 returns the prompt alone, streams
add up to the whole response; vLLM's prompt_logprobs on completions and chat; bad values are
400s; and lm-evaluation-harness's loglikelihood request, scored as lm-eval scores it."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import httpx
import msgspec
import pytest

from stoker.common.addresses import Addresses
from stoker.common.messages import RequestTokens, TokenBatch, TokenizeRequest, pack_ids
from stoker.common.sampling_params import SamplingParams
from stoker.services.tokenizer.service import TokenizerService

PROMPT_IDS = [74, 71, 469, 300, 12, 99, 5, 210]
TEXT = "Once upon a time there was"
MESSAGES = [{"role": "user", "content": "héllo!"}]
BOS = 1  # tests/factory.py's "<s>"
TOL = 1e-3


def _post(server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/{path}", json={"model": server.model_name, **body}, timeout=60
    )


def _ok(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": server.model_name, **body, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [msgspec.json.decode(line) for line in lines[:-1]]


def _offline(llm, prompt, k: int | None, max_tokens: int = 4, **kw):
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=k, prompt_logprobs=k, **kw
    )
    return llm.generate([prompt], params)[0]


def _prompt_text(llm, prompt) -> str:
    """What echo shows: a text prompt as given; ids as the tokenizer decodes them."""
    if isinstance(prompt, str):
        return prompt
    return llm.tokenizer.backend_tokenizer.decode(prompt, skip_special_tokens=False)


def _token(llm, token_id: int) -> str:
    return llm.tokenizer.decode([token_id])


PROMPTS = [pytest.param(TEXT, id="text"), pytest.param(PROMPT_IDS, id="ids")]


# -- echo -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [*PROMPTS, pytest.param([BOS, *PROMPT_IDS], id="ids-bos")])
def test_echo_text_is_prompt_then_completion(server, llm, prompt):
    ref = _offline(llm, prompt, None, max_tokens=8)
    out = _ok(
        server,
        "completions",
        {"prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": True, "ignore_eos": True},
    )
    [choice] = out["choices"]
    assert choice["text"] == _prompt_text(llm, prompt) + ref.text
    assert choice["logprobs"] is None and "prompt_logprobs" not in choice
    assert out["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert out["usage"]["completion_tokens"] == 8
    if prompt[0] == BOS:
        assert choice["text"].startswith("<s>")  # special tokens kept, as vLLM's echo


def _check_legacy(llm, lp: dict[str, Any], ids: list[int], ref_entries: list, k: int) -> None:
    """OpenAI's legacy logprobs of `ids` against the offline engine's entries."""
    assert lp["tokens"] == [_token(llm, t) for t in ids]
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) == len(ref_entries)
    for j, (t, got, top, want) in enumerate(
        zip(ids, lp["token_logprobs"], lp["top_logprobs"], ref_entries)
    ):
        if want is None:
            assert got is None and top is None, j
            continue
        assert got == pytest.approx(want.logprob, abs=TOL), j
        names = {_token(llm, i) for i in want.top_ids[:k]} | {_token(llm, t)}
        assert set(top) == names, j
        for i, x in zip(want.top_ids[:k], want.top_logprobs):
            assert top[_token(llm, i)] == pytest.approx(x, abs=TOL), j


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_echo_logprobs_equal_the_offline_engines(server, llm, prompt, k):
    ref = _offline(llm, prompt, k)
    out = _ok(
        server,
        "completions",
        {
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "echo": True,
            "logprobs": k,
            "ignore_eos": True,
        },
    )
    [choice] = out["choices"]
    ids = ref.prompt_token_ids + ref.token_ids
    entries = list(ref.prompt_logprobs) + list(ref.logprobs)
    assert entries[0] is None
    _check_legacy(llm, choice["logprobs"], ids, entries, k)
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]  # byte-level, ASCII
    assert choice["text"] == _prompt_text(llm, prompt) + ref.text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_max_tokens_0_returns_only_the_prompt(server, llm, prompt):
    ref = _offline(llm, prompt, 1, max_tokens=1)
    body = {"prompt": prompt, "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 1}
    out = _ok(server, "completions", body)
    [choice] = out["choices"]
    assert choice["text"] == _prompt_text(llm, prompt)
    assert choice["finish_reason"] == "length"
    _check_legacy(llm, choice["logprobs"], ref.prompt_token_ids, ref.prompt_logprobs, 1)
    n = len(ref.prompt_token_ids)
    assert out["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 0,
        "total_tokens": n,
        "prompt_tokens_details": out["usage"]["prompt_tokens_details"],
    }
    # Without logprobs too.
    out = _ok(server, "completions", {**body, "logprobs": None})
    assert out["choices"][0]["text"] == _prompt_text(llm, prompt)
    assert out["choices"][0]["logprobs"] is None


def _joined(chunks: list[dict[str, Any]], index: int = 0) -> tuple[str, dict[str, list] | None]:
    text, lps = "", None
    for c in chunks:
        for choice in c["choices"]:
            if choice["index"] != index:
                continue
            text += choice["text"]
            if choice["logprobs"] is not None:
                lps = lps or {key: [] for key in choice["logprobs"]}
                for key, values in choice["logprobs"].items():
                    lps[key] += values
    return text, lps


@pytest.mark.parametrize("max_tokens", [0, 6])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_echo_adds_up_to_the_whole(server, llm, prompt, max_tokens):
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    whole = _ok(server, "completions", {k: v for k, v in body.items() if k != "stream_options"})
    chunks = _stream(server, body)
    first = next(c for c in chunks if c["choices"])["choices"][0]
    assert first["text"].startswith(_prompt_text(llm, prompt))  # the prompt comes first
    text, lps = _joined(chunks)
    want = whole["choices"][0]
    assert text == want["text"]
    assert lps is not None
    assert lps["tokens"] == want["logprobs"]["tokens"]
    assert lps["text_offset"] == want["logprobs"]["text_offset"]
    assert lps["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=TOL)
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and not any(finishes[:-1])


def test_echo_with_n_choices(server, llm):
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": 5,
        "n": 2,
        "temperature": 1.0,
        "seed": 7,
        "echo": True,
        "logprobs": 1,
    }
    prefix = _prompt_text(llm, PROMPT_IDS)
    out = _ok(server, "completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c in out["choices"]:
        assert c["text"].startswith(prefix)
        assert c["logprobs"]["token_logprobs"][0] is None
        assert len(c["logprobs"]["tokens"]) == len(PROMPT_IDS) + 5
    chunks = _stream(server, body)
    for c in out["choices"]:
        assert _joined(chunks, c["index"])[0] == c["text"]
    assert out["usage"]["completion_tokens"] == 10


# -- vLLM's prompt_logprobs -------------------------------------------------------------------


def _check_vllm(llm, got: list, ids: list[int], ref_entries: list, k: int) -> None:
    """vLLM's shape: null, then {token_id: {logprob, rank, decoded_token}} per prompt token."""
    assert len(got) == len(ids) == len(ref_entries)
    assert got[0] is None
    for j, (t, entry, want) in enumerate(zip(ids[1:], got[1:], ref_entries[1:]), start=1):
        top = want.top_ids[:k]
        assert set(entry) == {str(i) for i in [t, *top]}, j
        actual = entry[str(t)]
        assert actual["logprob"] == pytest.approx(want.logprob, abs=TOL), j
        assert actual["decoded_token"] == _token(llm, t)
        assert actual["rank"] == (top.index(t) + 1 if t in top else None), j
        for r, (i, x) in enumerate(zip(top, want.top_logprobs), start=1):
            assert entry[str(i)]["rank"] == r, j
            assert entry[str(i)]["logprob"] == pytest.approx(x, abs=TOL), j


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_logprobs_on_completions(server, llm, prompt, k):
    ref = _offline(llm, prompt, k, max_tokens=2)
    out = _ok(
        server,
        "completions",
        {
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": k,
            "ignore_eos": True,
        },
    )
    [choice] = out["choices"]
    assert "prompt_logprobs" not in out  # vLLM's completions: per choice
    _check_vllm(llm, choice["prompt_logprobs"], ref.prompt_token_ids, ref.prompt_logprobs, k)
    assert choice["text"] == ref.text and choice["logprobs"] is None


def test_prompt_logprobs_on_chat(server, llm):
    ids = list(
        llm.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    ref = _offline(llm, ids, 2, max_tokens=3)
    body = {
        "messages": MESSAGES,
        "max_tokens": 3,
        "temperature": 0,
        "prompt_logprobs": 2,
        "ignore_eos": True,
        "n": 2,
    }
    out = _ok(server, "chat/completions", body)
    _check_vllm(llm, out["prompt_logprobs"], ids, ref.prompt_logprobs, 2)  # vLLM's: top-level
    assert all("prompt_logprobs" not in c for c in out["choices"])
    plain = _ok(server, "chat/completions", {**body, "prompt_logprobs": None})
    assert "prompt_logprobs" not in plain


def test_echo_and_prompt_logprobs_keep_their_own_k(server, llm):
    ref = _offline(llm, PROMPT_IDS, 4, max_tokens=1)
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": 0,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "prompt_logprobs": 4,
    }
    [choice] = _ok(server, "completions", body)["choices"]
    _check_legacy(llm, choice["logprobs"], PROMPT_IDS, ref.prompt_logprobs, 1)
    _check_vllm(llm, choice["prompt_logprobs"], PROMPT_IDS, ref.prompt_logprobs, 4)


def test_prompt_logprobs_0_in_a_stream_is_accepted_and_shown_nowhere(server):
    chunks = _stream(server, {"prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": 0})
    assert chunks and not any(
        "prompt_logprobs" in c or any("prompt_logprobs" in choice for choice in c["choices"])
        for c in chunks
    )


BAD = [
    ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": "2"}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("completions", {"echo": True, "logprobs": 21}, "logprobs"),
    ("completions", {"echo": True, "logprobs": -1}, "logprobs"),
    ("completions", {"echo": True, "max_tokens": -1}, "max_tokens"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo, as OpenAI
    ("chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"echo": True}, "echo"),  # completions only
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_values_are_400s(server, path, body, param):
    base = {"prompt": PROMPT_IDS} if path == "completions" else {"messages": MESSAGES}
    r = _post(server, path, {**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


# -- lm-evaluation-harness --------------------------------------------------------------------


def _lm_eval_parse(out: dict[str, Any], ctxlen: int, end: int | None) -> tuple[float, bool]:
    """lm_eval/models/openai_completions.py LocalCompletionsAPI.parse_logprobs, for one choice.
    end: -1 with max_tokens 1 (lm-eval today drops the generated token), None with max_tokens 0
    (the older OpenaiCompletionsLM, whose continuation runs to the end)."""
    [choice] = sorted(out["choices"], key=itemgetter("index"))
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:end])
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:end]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:end]
    is_greedy = True
    for tok, top in zip(tokens_logprobs, top_logprobs):
        if tok != max(top.values()):
            is_greedy = False
            break
    return logprobs, is_greedy


@pytest.mark.parametrize(("max_tokens", "end"), [(1, -1), (0, None)])
# A greedy continuation of the random model need not be text that tokenizes back the same.
@pytest.mark.parametrize(("form", "greedy"), [("ids", True), ("ids", False), ("text", False)])
def test_lm_eval_loglikelihood(server, llm, max_tokens, end, form, greedy):
    context = "Once upon a time"
    ctx_ids = llm.tokenizer.encode(context)
    if greedy:  # the model's own continuation: every token is its top choice
        continuation = _offline(llm, ctx_ids, None, max_tokens=4).token_ids
    else:
        continuation = llm.tokenizer.encode(" there was a dragon")
    ids = ctx_ids + list(continuation)
    prompt: list[Any] = [ids]  # lm-eval sends a batch (of one, at batch_size 1)
    if form == "text":
        text = llm.tokenizer.decode(ids)
        assert llm.tokenizer.encode(text) == ids  # the text tokenizes back to the same split
        prompt = [text]
    body = {
        "model": server.model_name,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    loglikelihood, is_greedy = _lm_eval_parse(r.json(), len(ctx_ids), end)

    [ref] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    entries = ref.prompt_logprobs[len(ctx_ids) :]
    assert loglikelihood == pytest.approx(sum(e.logprob for e in entries), abs=TOL)
    ref_greedy = all(e.top_ids[0] == t for e, t in zip(entries, continuation))
    assert is_greedy == ref_greedy
    assert is_greedy == greedy


# -- the tokenizer's part: a token-id prompt's text on the first delta ------------------------


def test_tokenizer_sends_the_prompt_text_once(model_path, tmp_path):
    svc = TokenizerService(model_path, "tok-echo", Addresses.in_run_dir(tmp_path))
    ids = [BOS, *PROMPT_IDS]
    params = SamplingParams(max_tokens=3)
    req = TokenizeRequest("e", params, prompt_token_ids=pack_ids(ids), return_prompt_text=True)
    svc.admit(req)
    first, _ = svc.detokenize(TokenBatch([RequestTokens("e", pack_ids([7]), num_prompt_tokens=9)]))
    want = svc.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)
    assert first.items[0].prompt_text == want and want.startswith("<s>")
    later, _ = svc.detokenize(TokenBatch([RequestTokens("e", pack_ids([8]))]))
    assert later.items[0].prompt_text is None
    svc.admit(TokenizeRequest("plain", params, prompt_token_ids=pack_ids(ids)))
    out, _ = svc.detokenize(TokenBatch([RequestTokens("plain", pack_ids([7]))]))
    assert out.items[0].prompt_text is None
