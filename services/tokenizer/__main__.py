"""`python -m services.tokenizer --model PATH [--id NAME] [--max-model-len N]`."""

from __future__ import annotations

import argparse
import socket
import uuid

from common.logs import add_log_format_arg, configure_logging
from services.tokenizer.service import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stoker tokenizer")
    parser.add_argument("--model", required=True, help="model folder (config.json + tokenizer)")
    parser.add_argument(
        "--id", default=None, help="slot name (default: tok-<host>); each process adds its own id"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    add_log_format_arg(parser)
    args = parser.parse_args(argv)
    configure_logging("tokenizer", args.log_format)
    # The slot survives a restart (compose keeps the hostname); the routing id is fresh per
    # process, so a restarted tokenizer is a new incarnation (pid 1 in every container).
    slot = args.id or f"tok-{socket.gethostname()}"
    serve(args.model, f"{slot}-{uuid.uuid4().hex[:8]}", args.max_model_len, slot)


if __name__ == "__main__":
    main()
