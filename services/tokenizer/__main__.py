"""`python -m stoker.services.tokenizer --model PATH [--id NAME] [--max-model-len N]`."""

from __future__ import annotations

import socket
import uuid

from stoker.common.config_args import service_config
from stoker.services.tokenizer.config import TokenizerConfig


def main(argv: list[str] | None = None) -> None:
    config = service_config("tokenizer", TokenizerConfig, argv)
    from stoker.services.tokenizer.service import serve  # the tokenizer libraries: not for --help

    slot = config.id or f"tok-{socket.gethostname()}"
    serve(
        config.model,
        f"{slot}-{uuid.uuid4().hex[:8]}",
        config.max_model_len,
        slot,
        config.grammar_compile_timeout,
    )


if __name__ == "__main__":
    main()
