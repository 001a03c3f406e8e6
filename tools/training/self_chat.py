"""User turns written by the target itself, for training a speculator on chat without a data set.

An instruction-tuned model that is shown its chat template up to where a user's message begins
continues with a plausible user message (Magpie, Xu et al. 2024). Sampling many of them gives
varied, natural prompts in the target's own domain, which no file has to supply; the target then
answers them when the training data is generated. A template of topics crossed with question
forms gives fewer kinds of question, and a head trained on its answers learns their phrasing
rather than the target's.

    stoker train-draft --method eagle --self-chat --num-prompts 1440 ...
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

SENTINEL = "\x00user turn\x00"


def user_turn_bounds(tok: object) -> tuple[str, str]:
    """(the template's text before a user's message, the text that ends it), from rendering a
    conversation of one sentinel message. ValueError when the tokenizer has no chat template
    or the template drops the message."""
    if not getattr(tok, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template")
    text = tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    if text.count(SENTINEL) != 1:
        raise ValueError("the chat template does not render a user message verbatim")
    before, after = text.split(SENTINEL)
    return before, after


def self_chat_turns(
    target: str | Path,
    n: int,
    seed: int = 0,
    exclude: Collection[str] = (),
    max_tokens: int = 64,
    device: str = "cpu",
) -> list[str]:
    """n distinct user turns sampled from the target (temperature 1, top-p 0.95, one seed per
    sample, so the same seed gives the same turns). A sample counts only if it ended its turn
    (the model's end of turn or end of sequence) within max_tokens and has at least three words;
    duplicates (ignoring case and spacing) and turns in `exclude` are dropped. ValueError if
    4n + 64 samples do not yield n."""
    from stoker.services.engine import LLM, SamplingParams

    llm = LLM(str(target), device=device)
    try:
        before, after = user_turn_bounds(llm.tokenizer)
        prefix = llm.tokenizer(before, add_special_tokens=False)["input_ids"]
        # The turn's end: the model's EOS (as <|im_end|> is SmolLM2's), or the template's text
        # after the message where that is plain text (as a blank line).
        stop = [after.strip() or after] if after else []
        banned = {_key(t) for t in exclude}
        seen: set[str] = set()
        turns: list[str] = []
        drawn = 0
        while len(turns) < n and drawn < 4 * n + 64:
            want = max(8, (n - len(turns)) * 5 // 4)
            params = [
                SamplingParams(
                    temperature=1.0,
                    top_p=0.95,
                    max_tokens=max_tokens,
                    seed=seed * 1_000_003 + drawn + i,
                    stop=stop,
                )
                for i in range(want)
            ]
            drawn += want
            for out in llm.generate([prefix] * want, params, use_tqdm=False):
                text = out.text.strip()
                key = _key(text)
                if out.finish_reason != "stop" or len(text.split()) < 3:
                    continue
                if key in seen or key in banned:
                    continue
                seen.add(key)
                turns.append(text)
        if len(turns) < n:
            raise ValueError(
                f"the target wrote {len(turns)} usable user turns of {n} in {drawn} samples"
            )
        return turns[:n]
    finally:
        llm.close()


def _key(text: str) -> str:
    return " ".join(text.casefold().split())
