"""`python -m services.tokenizer --model PATH [--id NAME] [--max-model-len N]`."""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.tokenizer")
    parser.add_argument("--model", required=True, help="model folder (config.json + tokenizer)")
    parser.add_argument("--id", default=None, help="routing id (default: tok-<pid>)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--log-level", default=os.environ.get("STOKER_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")

    from services.tokenizer.service import serve

    serve(args.model, args.id or f"tok-{os.getpid()}", args.max_model_len)


if __name__ == "__main__":
    main()
