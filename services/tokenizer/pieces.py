"""Each token's bytes, for tokenizers whose decode is a concatenation of per-token bytes.

A byte-level BPE decoder (GPT-2, Llama 3, Qwen, SmolLM2) turns each token into fixed bytes and
the whole output into text with one lossy UTF-8 conversion, so the streamed text of a token is
a table lookup: its bytes, joined to any bytes of a character still unfinished. That is what
`tokenizers.decoders.DecodeStream` computes by decoding a window twice per token, at a third of
the CPU. A table is only built after the tokenizer itself agrees with it (`build`): every token
between two plain ones, and random id runs through unfinished characters and special tokens.
Other decoders (SentencePiece's Metaspace, WordPiece) get no table and keep DecodeStream.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import decoders

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger("stoker.tokenizer")

_REPLACEMENT = "\ufffd"
_NUM_CHECK_RUNS = 64  # random id runs decoded both ways before a table is trusted
_CHECK_RUN_LEN = 48


@dataclass(frozen=True, slots=True)
class PieceTable:
    pieces: list[bytes]  # by token id: its bytes (b"" for a skipped special token)
    # by token id: its text when its bytes are whole characters (not ending in U+FFFD, which
    # a stream holds back as unfinished), else None: then the bytes are joined and decoded
    texts: list[str | None]


class PieceTables:
    """A tokenizer's tables, one per skip_special_tokens value, built on first use; None for
    a tokenizer whose decode is not per-token bytes."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self._tokenizer = tokenizer
        self._tables: dict[bool, PieceTable | None] = {}

    def get(self, skip_special_tokens: bool) -> PieceTable | None:
        if skip_special_tokens not in self._tables:
            self._tables[skip_special_tokens] = build(self._tokenizer, skip_special_tokens)
        return self._tables[skip_special_tokens]


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in kept:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def build(tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool) -> PieceTable | None:
    backend = tokenizer.backend_tokenizer
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    byte_of = _byte_level_chars()
    added = backend.get_added_tokens_decoder()
    # Ids may have gaps (a special token far past the rest): the table runs to the highest.
    size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    pieces: list[bytes] = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        special = token_id in added and added[token_id].special
        if token is None or (special and skip_special_tokens):  # a gap, or skipped
            pieces.append(b"")
        elif all(c in byte_of for c in token):
            pieces.append(bytes([byte_of[c] for c in token]))
        else:  # ByteLevel passes a token with characters outside its alphabet through as text
            pieces.append(token.encode())
    texts: list[str | None] = []
    for piece in pieces:
        text = piece.decode("utf-8", "replace")
        texts.append(None if text.endswith(_REPLACEMENT) else text)
    table = PieceTable(pieces, texts)
    problem = _disagreement(tokenizer, table, skip_special_tokens)
    if problem is not None:
        log.warning("no piece table for this tokenizer (%s): DecodeStream it is", problem)
        return None
    return table


def _disagreement(
    tokenizer: PreTrainedTokenizerFast, table: PieceTable, skip_special_tokens: bool
) -> str | None:
    """Why the tokenizer's own decode disagrees with the table, or None if it does not."""
    backend = tokenizer.backend_tokenizer
    anchor = next((i for i, p in enumerate(table.pieces) if p == b"a"), None)
    if anchor is None:
        return "no token for 'a'"
    # Each whole-character token between two anchors: its text, in context.
    ids = [i for i, text in enumerate(table.texts) if text is not None]
    decoded = backend.decode_batch([[anchor, i, anchor] for i in ids], skip_special_tokens)
    for token_id, text in zip(ids, decoded):
        if text != f"a{table.texts[token_id]}a":
            return f"token {token_id} decodes to {text!r} in context"
    # Runs of random ids, many of them parts of characters: one lossy decode of the joined
    # bytes, as a stream of them would end.
    rng = random.Random(0)
    partial = [i for i, text in enumerate(table.texts) if text is None]
    runs = [
        [rng.choice(partial) if partial and rng.random() < 0.5 else rng.randrange(len(table.pieces))
         for _ in range(_CHECK_RUN_LEN)]
        for _ in range(_NUM_CHECK_RUNS)
    ]  # fmt: skip
    for run, text in zip(runs, backend.decode_batch(runs, skip_special_tokens)):
        joined = b"".join(table.pieces[i] for i in run).decode("utf-8", "replace")
        if text != joined:
            return f"ids {run} decode to {text!r}, not {joined!r}"
    return None
