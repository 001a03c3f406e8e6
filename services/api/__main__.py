"""`python -m stoker.services.api --model PATH [--host H] [--port P] ...`: the api process."""

from __future__ import annotations

import argparse
import os

from stoker.common.config_args import add_config_json, add_flags, config_from, parse_args
from stoker.common.logs import add_log_format_arg, configure_logging


def main(argv: list[str] | None = None) -> None:
    from stoker.services.api.app import build_app
    from stoker.services.api.config import ApiConfig

    parser = argparse.ArgumentParser(prog="stoker api")
    add_flags(parser, ApiConfig)
    # Logging's own flags, as --log-format: read before the config, whose checks may log.
    parser.add_argument("--log-level", default=os.environ.get("STOKER_LOG_LEVEL", "INFO"))
    add_log_format_arg(parser)
    add_config_json(parser)
    args = parse_args(parser, argv)
    configure_logging("api", args.log_format, args.log_level)
    config = config_from(parser, ApiConfig, args)

    import uvicorn

    from stoker.common.addresses import Addresses
    from stoker.services.api.engine_client import EngineClient
    from stoker.services.api.request_log import RequestLog
    from stoker.services.api.server import DrainingServer
    from stoker.services.api.tokens import TokenStrings

    request_log = None
    if config.log_requests:
        request_log = RequestLog(
            config.log_requests,
            config.served_model_name,
            with_text=config.log_requests_text,
            max_bytes=config.log_requests_max_bytes,
            max_files=config.log_requests_max_files,
        )
    client = EngineClient(
        Addresses.from_env(),
        config.num_tokenizers,
        max_queued_requests=config.max_queued_requests,
        engine_lost_s=config.step_timeout_s,
        request_log=request_log,
    )
    app = build_app(client, config, TokenStrings(config.model_path))
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="auto",  # httptools (a dependency) where it is installed, else h11
        log_level="warning",
        log_config=None,  # uvicorn's loggers propagate to ours: one format for every line
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    DrainingServer(uv_config, app.state.api, config.shutdown_timeout).run()


if __name__ == "__main__":
    main()
