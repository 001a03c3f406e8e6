"""What a response shows of its prompt: OpenAI's `echo` on /v1/completions, and vLLM's
`prompt_logprobs` field on completions and chat; plus the legacy completions logprobs shape both
echo and plain completions render with.

echo (https://platform.openai.com/docs/api-reference/completions/create): the text is prompt +
completion (a token-id prompt's text is decoded by its tokenizer, special tokens kept, as vLLM
decodes it: TokenizeRequest.return_prompt_text); with `logprobs: k` the logprobs cover the
prompt's tokens first (the first token's logprob and top_logprobs are null: nothing precedes
it), then the generated ones. The engine computes the prompt's with
SamplingParams.prompt_logprobs (as vLLM's CompletionRequest does: `prompt_logprobs = logprobs`
under echo). `max_tokens: 0` (OpenAI's echo-only request, sent by
lm-evaluation-harness's older OpenaiCompletionsLM; today's LocalCompletionsAPI sends max_tokens
1 and drops the last entry itself) returns the prompt alone: the engine always generates at
least one token, so the request asks for 1 and the response drops it, from text, logprobs and
usage's completion_tokens, and ends with finish_reason "length" (nothing was generated: the
limit was 0). Streamed, the prompt and its logprobs come in each choice's first chunk. With
n > 1 every choice echoes the prompt, and each sub-request computes its prompt logprobs.

vLLM's `prompt_logprobs: k` (vllm/entrypoints/openai/protocol.py): one entry per prompt token,
null for the first, else `{token_id: {"logprob", "rank", "decoded_token"}}` holding the actual
token and the top k; per choice on completions (CompletionResponseChoice.prompt_logprobs),
top-level on chat (ChatCompletionResponse.prompt_logprobs).

Deviations from vLLM:
- `rank` of the actual token is null when it is not among the engine's top k: the engine
  reports the top k and the token's logprob, not its rank in the whole vocabulary (vLLM's
  Logprob.rank is optional too). Within the top k, ranks are exact.
- k is within [0, 20] (SamplingParams.MAX_LOGPROBS); vLLM's -1 (the whole vocabulary) is a 400.
- With `stream: true`, k > 0 is a 400 as in vLLM; k = 0 is accepted and, as in vLLM, shown
  nowhere, so it is not computed (prompt logprobs cost a full prompt pass: no prefix cache).
- The field appears only when asked for (vLLM's completions choices always carry it, null).
- `decoded_token` follows `return_tokens_as_token_ids` ("token_id:N"), like the logprobs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

from stoker.common.messages import TextDelta, TokenLogprobs, unpack_ids


class Strings(Protocol):
    """Token id -> string (services/api/tokens.py, or tokenize_routes.TokenIdStrings)."""

    def text(self, token_id: int) -> str: ...


@dataclasses.dataclass(frozen=True)
class PromptShown:
    """What a response shows of its prompt, as generation.py decodes it from the request."""

    echo: bool = False  # completions: the text (and logprobs) start with the prompt's
    text: str | None = None  # the request's text prompt; a token-id prompt's comes from a tokenizer
    echo_logprobs: int | None = None  # echo with logprobs: k alternatives per prompt token
    prompt_logprobs: int | None = None  # vLLM's field, when shown: k alternatives per token
    drop_output: bool = False  # echo with max_tokens 0: the one generated token is not shown

    @property
    def engine_k(self) -> int | None:
        """SamplingParams.prompt_logprobs: enough for both views (each shows its own k)."""
        ks = [k for k in (self.echo_logprobs, self.prompt_logprobs) if k is not None]
        return max(ks) if ks else None

    @property
    def wants_prompt(self) -> bool:
        """Whether the first delta must bring the prompt (ids, logprobs or text)."""
        return self.engine_k is not None or (self.echo and self.text is None)


NOTHING_SHOWN = PromptShown()


@dataclasses.dataclass
class Prompt:
    """A choice's prompt, from its first delta."""

    ids: list[int]
    logprobs: list[TokenLogprobs | None] | None
    text: str | None  # a token-id prompt's text (TokenizeRequest.return_prompt_text)


def prompt_of(d: TextDelta) -> Prompt | None:
    if d.prompt_token_ids is None and d.prompt_text is None:
        return None
    ids = [] if d.prompt_token_ids is None else unpack_ids(d.prompt_token_ids)
    return Prompt(ids, d.prompt_logprobs, d.prompt_text)


def drop_output(d: TextDelta) -> None:
    """Echo with max_tokens 0: the engine generated one token (it always generates one), which
    the response does not show. In place, before any view of the delta is built."""
    d.text, d.token_ids, d.logprobs = "", b"", None
    if d.finish_reason is not None and d.finish_reason != "abort" and d.error is None:
        d.finish_reason = "length"


def lp(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0  # JSON has no -inf


def completion_logprobs(
    strings: Strings,
    ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    offset: int,
    k: int | None = None,
) -> dict[str, list[Any]]:
    """OpenAI's legacy completions logprobs for tokens at text offset `offset`: an entry of None
    (a prompt's first token) has null token_logprobs and top_logprobs. top_logprobs holds the
    top k (None: all the engine gave) plus the actual token, as OpenAI's does."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    s = strings
    for t, e in zip(ids, entries):
        tok = s.text(t)
        tokens.append(tok)
        offsets.append(offset)
        offset += len(tok)
        if e is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        top_ids = e.top_ids if k is None else e.top_ids[:k]
        entry = {s.text(i): lp(x) for i, x in zip(top_ids, e.top_logprobs)}
        entry.setdefault(tok, lp(e.logprob))
        token_logprobs.append(lp(e.logprob))
        top.append(entry)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def join_logprobs(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + then[key] for key in first}


def echo_part(
    shown: PromptShown, prompt: Prompt | None, strings: Strings, offset: int
) -> tuple[str, dict[str, list[Any]] | None]:
    """The echoed prompt: its text, and its logprobs when the request asked for logprobs."""
    text = shown.text if shown.text is not None else (prompt.text if prompt else None) or ""
    if shown.echo_logprobs is None:
        return text, None
    if prompt is None or prompt.logprobs is None:
        return text, completion_logprobs(strings, [], [], offset)
    return text, completion_logprobs(
        strings, prompt.ids, prompt.logprobs, offset, shown.echo_logprobs
    )


def vllm_prompt_logprobs(
    prompt: Prompt | None, k: int, strings: Strings
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, null for the first, else the actual token and
    the top k by id (JSON keys are strings), each {logprob, rank, decoded_token}."""
    if prompt is None or prompt.logprobs is None:
        return None
    out: list[dict[int, dict[str, Any]] | None] = []
    for t, e in zip(prompt.ids, prompt.logprobs):
        if e is None:
            out.append(None)
            continue
        rank = e.top_ids.index(t) + 1 if t in e.top_ids else None
        entry = {t: {"logprob": lp(e.logprob), "rank": rank, "decoded_token": strings.text(t)}}
        for r, (i, x) in enumerate(zip(e.top_ids[:k], e.top_logprobs), start=1):
            entry[i] = {"logprob": lp(x), "rank": r, "decoded_token": strings.text(i)}
        out.append(entry)
    return out
