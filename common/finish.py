"""How a request's finish is reported, one rule for the offline `LLM` and the tokenizer service.

The engine ends a request on token ids ("stop": eos / stop_token_ids; "length": max_tokens or the
context length; "abort"). Stop strings are found later, by the detokenizer. When both end a
request in the same step, the stop string wins and the reason is "stop", as in vLLM: the text
was cut at the stop string, so reporting "length" would misdescribe it.
"""

from __future__ import annotations

from collections.abc import Sequence


def finish_reason(engine_reason: str | None, stop_string_matched: bool) -> str | None:
    """The reason to report: "stop" once a stop string matched, else the engine's (or None)."""
    return "stop" if stop_string_matched else engine_reason


def text_token_ids(
    token_ids: Sequence[int],
    engine_reason: str | None,
    stop_ids: frozenset[int],
    include_stop_str_in_output: bool,
) -> Sequence[int]:
    """The ids to detokenize: like vLLM, the eos / stop token that ended generation is not text."""
    if (
        engine_reason == "stop"
        and token_ids
        and token_ids[-1] in stop_ids
        and not include_stop_str_in_output
    ):
        return token_ids[:-1]
    return token_ids
