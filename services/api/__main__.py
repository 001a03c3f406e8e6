"""`python -m services.api --model PATH [--host H] [--port P] [--served-model-name NAME] ...`"""

from __future__ import annotations

import argparse
import os

from common.logs import add_log_format_arg, configure_logging


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
    add_safety_args(parser)
    add_request_log_args(parser)
    parser.add_argument(
        "--profile-dir", default=None, help="turn on POST /start_profile and /stop_profile"
    )
    add_log_format_arg(parser)
    args = parser.parse_args(argv)
    configure_logging("api", args.log_format, args.log_level)

    import uvicorn

    from common.addresses import Addresses
    from common.model_registry import resolve_model, served_model_name
    from services.api.app import ApiConfig, build_app
    from services.api.engine_client import EngineClient
    from services.api.protocol import Limits
    from services.api.request_log import RequestLog
    from services.api.server import DrainingServer
    from services.api.tokens import TokenStrings

    name = args.served_model_name or served_model_name(args.model)
    config = ApiConfig(
        name,
        args.max_request_bytes,
        limits=Limits(max_n=args.max_n),
        api_key=args.api_key or None,
        protect_metrics=args.protect_metrics,
        request_timeout_s=args.request_timeout_s,
        model_path=str(resolve_model(args.model)),
        profile_dir=args.profile_dir,
    )
    request_log = None
    if args.log_requests:
        request_log = RequestLog(
            args.log_requests,
            name,
            with_text=args.log_requests_text,
            max_bytes=args.log_requests_max_bytes,
            max_files=args.log_requests_max_files,
        )
    client = EngineClient(
        Addresses.from_env(),
        args.num_tokenizers,
        max_queued_requests=args.max_queued_requests,
        engine_lost_s=args.step_timeout_s,
        request_log=request_log,
    )
    app = build_app(client, config, TokenStrings(str(resolve_model(args.model))))
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="auto",  # httptools (a dependency) where it is installed, else h11
        log_level="warning",
        log_config=None,  # uvicorn's loggers propagate to ours: one format for every line
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    DrainingServer(uv_config, app.state.api, args.shutdown_timeout).run()


def add_safety_args(parser: argparse.ArgumentParser) -> None:
    """Limits and access flags; `stoker serve` takes the same ones and passes them on."""
    g = parser.add_argument_group("limits and access (docs/reliability.md)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("STOKER_API_KEY"),
        help="require `Authorization: Bearer KEY` (env STOKER_API_KEY; /health stays open)",
    )
    g.add_argument("--protect-metrics", action="store_true", help="/metrics needs the key too")
    g.add_argument("--max-n", type=int, default=128, help="largest n (choices) per request")
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="sub-requests waiting for their first token; past it new requests get 503",
    )
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="end a request that has not finished in this many seconds (default: no deadline)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take to finish",
    )
    g.add_argument(
        "--step-timeout-s",
        type=float,
        default=60.0,
        help="an engine step (or the scheduler's stats) silent this long means the engine failed",
    )


def add_request_log_args(parser: argparse.ArgumentParser) -> None:
    """The token-ID request log (docs/observability.md); `stoker serve` passes these on."""
    from services.api.request_log import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES

    g = parser.add_argument_group("request log (docs/observability.md)")
    g.add_argument(
        "--log-requests",
        metavar="DIR",
        default=None,
        help="write one JSON line per finished choice (token ids, timings) to DIR",
    )
    g.add_argument(
        "--log-requests-text",
        action="store_true",
        help="also log prompt and output text (left out by default)",
    )
    g.add_argument(
        "--log-requests-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help=f"start a new file past this size (default {DEFAULT_MAX_BYTES >> 20} MiB)",
    )
    g.add_argument(
        "--log-requests-max-files",
        type=int,
        default=DEFAULT_MAX_FILES,
        help=f"files kept in DIR; the oldest is deleted (default {DEFAULT_MAX_FILES})",
    )


if __name__ == "__main__":
    main()
