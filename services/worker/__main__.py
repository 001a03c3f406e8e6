"""`python -m services.worker [engine flags]`: the worker process."""

from __future__ import annotations

import argparse
import signal

from stoker.common.addresses import Addresses
from stoker.common.config import EngineConfig
from stoker.common.config_args import add_config_json, add_flags, config_from, parse_args
from stoker.common.logs import add_log_format_arg, configure_logging
from stoker.common.shutdown import exit_on_sigterm
from stoker.services.worker.service import run_worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stoker worker", description=__doc__)
    add_flags(parser, EngineConfig)
    add_log_format_arg(parser)
    add_config_json(parser)
    args = parse_args(parser, argv)
    configure_logging("worker", args.log_format)
    config = config_from(parser, EngineConfig, args)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    run_worker(config, Addresses.from_env(), config.profile_dir)


if __name__ == "__main__":
    main()
