"""`python -m services.tokenizer --model PATH [--id NAME] [--max-model-len N]`."""

from __future__ import annotations

import argparse
import socket
import uuid

from stoker.common.config_args import add_config_json, add_flags, config_from, parse_args
from stoker.common.logs import add_log_format_arg, configure_logging
from stoker.services.tokenizer.config import TokenizerConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stoker tokenizer")
    add_flags(parser, TokenizerConfig)
    add_log_format_arg(parser)
    add_config_json(parser)
    args = parse_args(parser, argv)
    configure_logging("tokenizer", args.log_format)
    config = config_from(parser, TokenizerConfig, args)
    from stoker.services.tokenizer.service import serve  # the tokenizer libraries: not for --help

    slot = config.id or f"tok-{socket.gethostname()}"
    serve(config.model, f"{slot}-{uuid.uuid4().hex[:8]}", config.max_model_len, slot)


if __name__ == "__main__":
    main()
