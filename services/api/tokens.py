"""Token id -> (string, bytes) for logprobs, from tokenizer.json alone (or a GGUF's metadata).

The api does not detokenize text (tokenizers do); it only names single tokens in logprobs. The
`tokenizers` library is enough for that and keeps transformers/torch out of this process.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from tokenizers import Tokenizer

from stoker.common.tokenizer_files import tokenizer_json

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decode_map() -> dict[str, int]:
    """GPT-2's byte <-> printable-char table, inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenStrings:
    def __init__(self, model_folder: str | Path) -> None:
        spec = tokenizer_json(model_folder)
        self._tok = Tokenizer.from_str(spec)
        decoder = json.loads(spec).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        self._byte_level = "ByteLevel" in kinds
        self._special = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per process
    def bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return self._special[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_level_decode_map()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word-start marker

    def text(self, token_id: int) -> str:
        """The token as text; a token that is part of a UTF-8 character reads as U+FFFD."""
        return self.bytes(token_id).decode("utf-8", errors="replace")
