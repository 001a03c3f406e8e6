"""Sans-IO incremental detokenizer with OpenAI-style stop strings, one instance per request.

The streamed text (before stop strings) is the output decoded *in context*, as vLLM streams it:
decode(prompt + output) past decode(prompt). For byte-level BPE that equals decode(output); for
SentencePiece/Metaspace tokenizers decode(output) alone would drop the first output token's
leading space ("▁world" -> "world"), while in context it is " world". (Edge case: if the output
finishes a character the prompt began, the whole character is output.) Like vLLM, HF's
clean_up_tokenization_spaces is not applied. The caller decides which ids to feed, e.g. whether
a final eos / stop token id is detokenized.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from stoker.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from stoker.services.tokenizer.pieces import PieceTables

# Prompt tokens primed into the stream so the first output token decodes as it would in a full
# decode (leading-space rules, preceding bytes). Only the previous token matters for common
# tokenizers; a few more is cheap. Same order of magnitude as vLLM.
_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class DetokenizerDelta:
    text: str  # new text to stream (may be "")
    stopped: bool


class IncrementalDetokenizer:
    """Turns output token ids into text deltas in O(new tokens) per call.

    Decoding is delegated to `tokenizers.decoders.DecodeStream`, which only re-decodes a small
    window and returns None while the text ends in an unfinished UTF-8 character, so no delta
    ever contains half a character; or, for byte-level tokenizers given `pieces`, to a table of
    each token's bytes that gives the same text (services/tokenizer/pieces.py). On top of it we
    hold back the shortest tail that could still grow into a stop string, so text after a stop
    string is never streamed.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        pieces: PieceTables | None = None,
    ) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        # No stop strings: text streams as it decodes and never stops here (add_token applies).
        self.plain = not self._stops
        self._include_stop = params.include_stop_str_in_output
        self.stopped = False
        self.stop_reason: str | None = None
        self._held = ""  # decoded but not yet streamed: might be the start of a stop string

        # Mirror of the stream's window, for finish(): ids whose text is accounted for, and ids
        # stepped since the stream last produced text (an unfinished character).
        self._context: collections.deque[int] = collections.deque(maxlen=_CONTEXT_TOKENS)
        self._pending: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        self._prompt_residue = ""
        # With a table, bytes of an unfinished character wait here instead of in _pending.
        self._bytes = b""
        table = None if pieces is None else pieces.get(self._skip_special)
        self._table = table
        if table is not None:
            self._pieces, self._texts = table.pieces, table.texts
            self._step = self._step_table  # type: ignore[method-assign]
        # Prime the stream with the prompt's tail (its text is discarded) so the first output
        # token decodes in context.
        for token_id in prompt_token_ids[-_CONTEXT_TOKENS:]:
            self._step(token_id)
        # A prompt whose decode ends in U+FFFD leaves tokens pending in the stream, and their
        # text would come out with the first output text. If the output finishes the character,
        # it counts as output; the U+FFFDs that stay (genuine ones, or bytes never finished) are
        # prompt text, dropped from the first output text.
        if self._pending_text():
            self._prompt_residue = self._flush_pending()

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        if self.stopped:
            return DetokenizerDelta("", True)
        if len(token_ids) == 1:  # the common case: one decode step's token
            return self._emit(self._step(token_ids[0]), final=False)
        return self._emit("".join([self._step(t) for t in token_ids]), final=False)

    def add_token(self, token_id: int) -> str:
        """One token's new text, for a `plain` detokenizer: what add_tokens([token_id]).text is,
        without the stop-string machinery (the tokenizer's per-token hot path)."""
        return self._step(token_id)

    def finish(self) -> DetokenizerDelta:
        """Flush at end of generation. Held text can no longer become a stop string, so it is
        emitted; bytes of a character that was never finished become U+FFFD, as in a full
        decode (errors='replace')."""
        if self.stopped:
            return DetokenizerDelta("", True)
        tail = self._drop_prompt_residue(self._flush_pending()) if self._pending_text() else ""
        self._context.clear()
        self._pending = []
        self._bytes = b""
        return self._emit(tail, final=True)

    def _pending_text(self) -> bool:
        """Whether tokens were stepped whose text is not out yet (an unfinished character)."""
        return bool(self._pending or self._bytes)

    def _step_table(self, token_id: int) -> str:
        """_step from the piece table: what DecodeStream gives for a byte-level tokenizer."""
        if token_id >= len(self._pieces):
            return ""  # an id past the tokenizer's vocabulary (a padded row): no text
        if not self._bytes:
            text = self._texts[token_id]
            if text is not None:
                return self._drop_prompt_residue(text) if self._prompt_residue else text
        joined = self._bytes + self._pieces[token_id]
        text = joined.decode("utf-8", "replace")
        if text.endswith("\ufffd"):  # held back, as DecodeStream holds an unfinished character
            self._bytes = joined
            return ""
        self._bytes = b""
        return self._drop_prompt_residue(text) if self._prompt_residue else text

    def _step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._tokenizer, token_id)
        except Exception as e:
            if "Invalid prefix" not in str(e):
                raise
            # Some decoders are not prefix-stable (vllm-project/vllm#17448), which breaks the
            # stream's window. Restart without context rather than fail the request.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            self._context.clear()
            self._pending, self._prompt_residue = [], ""
            piece = self._stream.step(self._tokenizer, token_id)
        if piece is None:
            self._pending.append(token_id)
            return ""
        if self._pending:
            self._context.extend(self._pending)
            self._pending = []
        self._context.append(token_id)
        return self._drop_prompt_residue(piece) if self._prompt_residue else piece

    def _flush_pending(self) -> str:
        """Text of the pending ids, unfinished characters replaced, as the stream would give."""
        if self._table is not None:
            return self._bytes.decode("utf-8", "replace")
        context = list(self._context)
        prefix = self._decode(context)
        full = self._decode(context + self._pending)
        return full[len(prefix) :] if full.startswith(prefix) else self._decode(self._pending)

    def _drop_prompt_residue(self, text: str) -> str:
        residue, self._prompt_residue = self._prompt_residue, ""
        return text[len(os.path.commonprefix([residue, text])) :]

    def _emit(self, new_text: str, final: bool) -> DetokenizerDelta:
        if not self._stops:
            return DetokenizerDelta(new_text, False)
        # Only held text plus new text can contain a stop string: anything streamed earlier was
        # released precisely because no stop string could start in it.
        buf = self._held + new_text
        match = self._find_stop(buf)
        if match is not None:
            start, stop = match
            out = buf[: start + len(stop) if self._include_stop else start]
            self._held, self.stopped, self.stop_reason = "", True, stop
        else:
            keep = 0 if final else self._partial_stop_len(buf)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        return DetokenizerDelta(out, self.stopped)

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """The stop string that is complete first (smallest end; ties: longest). Generation
        stops as soon as any stop string appears, so this is the only rule that does not
        depend on how tokens were chunked into add_tokens calls."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
