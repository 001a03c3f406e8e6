"""`python -m services.tokenizer --model PATH [--id NAME] [--max-model-len N]`."""

from __future__ import annotations

import argparse
import socket
import uuid
from dataclasses import dataclass

from common.config import MAX_MODEL_LEN
from common.config_args import add_config_json, add_flags, config_from, flag, parse_args
from common.logs import add_log_format_arg, configure_logging


@dataclass
class TokenizerConfig:
    model: str = flag(help="model folder (config.json + tokenizer)", required=True)
    # The slot survives a restart (compose keeps the hostname); the routing id is fresh per
    # process, so a restarted tokenizer is a new incarnation (pid 1 in every container).
    id: str | None = flag(None, "slot name (default: tok-<host>); each process adds its own id")
    max_model_len: int | None = MAX_MODEL_LEN.field()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stoker tokenizer")
    add_flags(parser, TokenizerConfig)
    add_log_format_arg(parser)
    add_config_json(parser)
    args = parse_args(parser, argv)
    configure_logging("tokenizer", args.log_format)
    config = config_from(parser, TokenizerConfig, args)
    from services.tokenizer.service import serve  # the tokenizer libraries: not for --help

    slot = config.id or f"tok-{socket.gethostname()}"
    serve(config.model, f"{slot}-{uuid.uuid4().hex[:8]}", config.max_model_len, slot)


if __name__ == "__main__":
    main()
