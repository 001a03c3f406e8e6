"""`python -m services.worker [engine flags]`: the worker process."""

from __future__ import annotations

import argparse
import signal

from common.addresses import Addresses
from common.logs import add_log_format_arg, configure_logging
from common.shutdown import exit_on_sigterm
from services.engine_args import add_engine_args, engine_config_from_args
from services.worker.service import run_worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stoker worker", description=__doc__)
    add_engine_args(parser)
    add_log_format_arg(parser)
    args = parser.parse_args(argv)
    configure_logging("worker", args.log_format)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    run_worker(engine_config_from_args(args), Addresses.from_env(), args.profile_dir)


if __name__ == "__main__":
    main()
