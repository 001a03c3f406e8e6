"""OpenAI response bodies (completions and chat, whole and streamed) from tokenizer deltas.
What they show of the prompt (echo, vLLM's prompt_logprobs): prompt_logprob_render.py."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from stoker.common.messages import TextDelta, TokenLogprobs, num_ids, unpack_ids
from stoker.services.api.prompt_logprob_render import (
    NOTHING_SHOWN,
    Prompt,
    PromptShown,
    completion_logprobs,
    drop_output,
    echo_part,
    join_logprobs,
    lp,
    prompt_of,
    vllm_prompt_logprobs,
)
from stoker.services.api.tokens import TokenStrings
from stoker.services.api.tool_output import ToolOutput


@dataclasses.dataclass
class Choice:
    index: int
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # completions logprobs: offset of the next token in the output text
    # The pieces as they came: joined only by a whole response (a stream never needs them), and
    # not re-copied per delta as `text += piece` on an attribute would be.
    text_parts: list[str] = dataclasses.field(default_factory=list)
    token_id_parts: list[bytes] = dataclasses.field(default_factory=list)
    prompt: Prompt | None = None  # from the first delta, when the response shows the prompt
    echoed: bool = False  # a stream sent the echoed prompt

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def token_ids(self) -> list[int]:
        return unpack_ids(b"".join(self.token_id_parts))


class Accumulator:
    """Collects the deltas of one API call's n sub-requests (`{req_id}-{i}`)."""

    def __init__(
        self, req_id: str, n: int, whole: bool = True, shown: PromptShown = NOTHING_SHOWN
    ) -> None:
        self.choices = [Choice(i) for i in range(n)]
        self._index = {f"{req_id}-{i}": i for i in range(n)}
        self._only = self.choices[0] if n == 1 else None  # no lookup per delta for one choice
        # whole: a whole response is built from the choices, which keep every delta's text, ids
        # and logprobs. A stream sends those as they come and keeps none of them.
        self._whole = whole
        self._shown = shown if shown.drop_output or shown.wants_prompt else None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.error: str | None = None
        self.error_status = 500

    def add(self, d: TextDelta) -> Choice:
        c = self._only or self.choices[self._index[d.req_id]]
        if self._shown is not None:  # one check per delta for the usual request
            if self._shown.drop_output:
                drop_output(d)  # in place, so a stream's chunks see the same
            if self._shown.wants_prompt and c.prompt is None:
                c.prompt = prompt_of(d)
        if d.error is not None and self.error is None:
            self.error, self.error_status = d.error, d.error_status
        if d.num_prompt_tokens:
            self.prompt_tokens = d.num_prompt_tokens
            self.cached_tokens = d.num_cached_tokens
        if self._whole:
            c.text_parts.append(d.text)
            c.token_id_parts.append(d.token_ids)
            if d.logprobs:
                c.logprobs += d.logprobs
        c.num_tokens += num_ids(d.token_ids)
        if d.finish_reason is not None or d.error is not None:
            c.finish_reason = d.finish_reason or "abort"
        return c

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def aborted(self) -> bool:
        return any(c.finish_reason == "abort" for c in self.choices)

    def usage(self) -> dict[str, Any]:
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Formatter:
    def __init__(
        self,
        kind: Literal["completion", "chat"],
        req_id: str,
        model: str,
        strings: TokenStrings,
        logprobs: bool,
        tools: ToolOutput | None = None,
        shown: PromptShown = NOTHING_SHOWN,
    ) -> None:
        self.kind, self.id, self.model, self.strings = kind, req_id, model, strings
        self.with_logprobs = logprobs
        self.shown = shown
        self.tools = tools  # set when calls are parsed out of a chat's output
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # -- whole responses ------------------------------------------------------------------------

    def response(self, acc: Accumulator) -> dict[str, Any]:
        choices = []
        shown = self.shown
        for c in acc.choices:
            choice: dict[str, Any] = {"index": c.index}
            finish = c.finish_reason
            if self.kind == "completion":
                choice["text"], choice["logprobs"] = self._completion(c)
            else:
                if self.tools is not None:
                    choice["message"], finish = self.tools.message(c.index, c.text, finish)
                else:
                    choice["message"] = {"role": "assistant", "content": c.text}
                choice["logprobs"] = self._logprobs(c.token_ids, c.logprobs, 0)
            choice["finish_reason"] = finish
            if self.kind == "completion" and shown.prompt_logprobs is not None:
                k = shown.prompt_logprobs
                choice["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt, k, self.strings)
            choices.append(choice)
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        out = {**self._envelope(obj, choices), "usage": acc.usage()}
        if self.kind == "chat" and shown.prompt_logprobs is not None:  # vLLM's: top-level
            prompt = acc.choices[0].prompt  # every choice has the same prompt
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                prompt, shown.prompt_logprobs, self.strings
            )
        return out

    def _completion(self, c: Choice) -> tuple[str, dict[str, Any] | None]:
        """A whole completion choice's text and logprobs, the echoed prompt first."""
        if not self.shown.echo:
            return c.text, self._logprobs(c.token_ids, c.logprobs, 0)
        text, prompt_lps = echo_part(self.shown, c.prompt, self.strings, 0)
        if prompt_lps is None:
            return text + c.text, self._logprobs(c.token_ids, c.logprobs, 0)
        offset = sum(len(t) for t in prompt_lps["tokens"])
        output_lps = self._logprobs(c.token_ids, c.logprobs, offset)
        assert output_lps is not None  # echo's logprobs are the request's
        return text + c.text, join_logprobs(prompt_lps, output_lps)

    # -- streamed chunks ------------------------------------------------------------------------

    def chunk(self, c: Choice, deltas: list[TextDelta]) -> dict[str, Any] | None:
        """One event for a choice's coalesced deltas; None when there is nothing to say."""
        text = deltas[0].text if len(deltas) == 1 else "".join(d.text for d in deltas)
        finish = deltas[-1].finish_reason
        lps: list[TokenLogprobs] = []
        if self.with_logprobs:  # the ids are only needed to name the logprobs' tokens
            lps = [x for d in deltas for x in (d.logprobs or [])]
        if self.tools is not None:
            return self._tool_chunk(c, text, finish, deltas, lps)
        echo_text, echo_lps = "", None
        if self.shown.echo and not c.echoed:  # the choice's first chunk: the prompt first
            c.echoed = True
            echo_text, echo_lps = echo_part(self.shown, c.prompt, self.strings, c.text_offset)
            text = echo_text + text
        if not text and finish is None and not lps and echo_lps is None:
            return None
        logprobs = None
        if self.with_logprobs:
            ids = [t for d in deltas for t in unpack_ids(d.token_ids)]
            start = c.text_offset
            if echo_lps is not None:
                start += sum(len(t) for t in echo_lps["tokens"])
            logprobs = self._logprobs(ids, lps, start)
            if echo_lps is not None and logprobs is not None:
                logprobs = join_logprobs(echo_lps, logprobs)
        if self.kind == "completion":
            c.text_offset += sum(len(s) for s in logprobs["tokens"]) if logprobs else 0
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return self._envelope("text_completion", [choice])
        delta = {"content": text} if text or finish is None else {}
        choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope("chat.completion.chunk", [choice])

    def _tool_chunk(
        self,
        c: Choice,
        text: str,
        finish: str | None,
        deltas: list[TextDelta],
        lps: list[TokenLogprobs],
    ) -> dict[str, Any] | None:
        assert self.tools is not None
        delta, finish = self.tools.delta(c.index, text, finish)
        if not delta and finish is None and not lps:
            return None  # held back: it may still open a call
        logprobs = None
        if self.with_logprobs:
            ids = [t for d in deltas for t in unpack_ids(d.token_ids)]
            logprobs = self._logprobs(ids, lps, 0)
        choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope("chat.completion.chunk", [choice])

    def role_chunk(self, index: int) -> dict[str, Any]:
        # With calls parsed, no content until there is some: a choice of calls alone then
        # adds up to content null, as its whole response says.
        delta = (
            {"role": "assistant"}
            if self.tools is not None
            else {"role": "assistant", "content": ""}
        )
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, acc: Accumulator) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._envelope(obj, []), "usage": acc.usage()}

    # -- logprobs -------------------------------------------------------------------------------

    def _logprobs(
        self, ids: list[int], lps: list[TokenLogprobs], offset: int
    ) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        if self.kind == "chat":
            return {
                "content": [
                    {
                        **self._chat_token(t, e.logprob),
                        "top_logprobs": [
                            self._chat_token(i, x) for i, x in zip(e.top_ids, e.top_logprobs)
                        ],
                    }
                    for t, e in zip(ids, lps)
                ],
                "refusal": None,
            }
        return completion_logprobs(self.strings, ids, lps, offset)

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        b = self.strings.bytes(token_id)
        return {
            "token": b.decode("utf-8", errors="replace"),
            "logprob": lp(logprob),
            "bytes": list(b),
        }
