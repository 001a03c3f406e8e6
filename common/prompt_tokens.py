"""Prompt -> token ids: the one function the tokenizer processes and the api's /tokenize share.

A plain prompt is `tokenizer.encode(prompt)` (the tokenizer's own special tokens, e.g. a BOS);
chat messages go through the model's chat template with `tokenize=True`, which adds no special
tokens beyond what the template writes. `/tokenize` exists to show exactly what a request gets,
so it must not carry a second copy of this logic that could drift from the request path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def prompt_token_ids(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The ids a request with this prompt (or these messages) is served with.

    add_special_tokens=None is what requests get: True for a prompt, none beyond the template
    for messages. True for messages renders the template to text and encodes that with the
    tokenizer's special tokens, as vLLM's /tokenize does (it may double a BOS: on purpose, so
    a client can see that it would). tools, chat_template_kwargs and continue_final_message
    go to the template as in vLLM (docs/tool-calling.md)."""
    if messages is not None:
        template_args: dict[str, Any] = dict(chat_template_kwargs or {})
        template_args.update(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        if tools:
            template_args["tools"] = tools
        if add_special_tokens:
            text = tokenizer.apply_chat_template(list(messages), tokenize=False, **template_args)
            return list(tokenizer.encode(text, add_special_tokens=True))
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=False, **template_args
        )
        # transformers 5 may hand back a BatchEncoding or a nested list: flatten to ids.
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(t) for t in out]
    if prompt is None:
        raise ValueError("the request has no prompt")
    if not prompt:
        raise ValueError("the prompt is empty")
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False))
