"""`python -m services.api --model PATH [--host H] [--port P] [--served-model-name NAME] ...`"""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.api")
    parser.add_argument("--model", required=True, help="model name or path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", default=None, help="default: the model's short or file name"
    )
    parser.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024)
    parser.add_argument(
        "--num-tokenizers", type=int, default=1, help="/health needs this many tokenizers up"
    )
    # Accepted for symmetry with the other services; the tokenizers enforce the limit.
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--log-level", default=os.environ.get("STOKER_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")

    import uvicorn

    from common.addresses import Addresses
    from common.model_registry import resolve_model, served_model_name
    from services.api.app import ApiConfig, build_app
    from services.api.engine_client import EngineClient
    from services.api.tokens import TokenStrings

    name = args.served_model_name or served_model_name(args.model)
    config = ApiConfig(name, args.max_request_bytes)
    client = EngineClient(Addresses.from_env(), args.num_tokenizers)
    app = build_app(client, config, TokenStrings(str(resolve_model(args.model))))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=3,
    )


if __name__ == "__main__":
    main()
