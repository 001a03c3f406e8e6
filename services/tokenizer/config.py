"""The tokenizer process's settings; each field is a flag (common/config_args.py). Light to
import: `stoker serve` reads it for the flags."""

from __future__ import annotations

from dataclasses import dataclass

from stoker.common.config import MAX_MODEL_LEN
from stoker.common.config_args import flag


@dataclass
class TokenizerConfig:
    model: str = flag(help="model folder (config.json + tokenizer)", required=True)
    # The slot survives a restart (compose keeps the hostname); the routing id is fresh per
    # process, so a restarted tokenizer is a new incarnation (pid 1 in every container).
    id: str | None = flag(None, "slot name (default: tok-<host>); each process adds its own id")
    max_model_len: int | None = MAX_MODEL_LEN.field()
    grammar_compile_timeout: float = flag(
        2.0,
        "seconds a structured-output grammar may take to compile before its request gets a 400 "
        "(docs/structured-outputs.md)",
    )
