"""`python -m stoker.services.worker [engine flags]`: the worker process."""

from __future__ import annotations

import signal

from stoker.common.addresses import Addresses
from stoker.common.config import EngineConfig
from stoker.common.config_args import service_config
from stoker.common.shutdown import exit_on_sigterm
from stoker.services.worker.service import run_worker


def main(argv: list[str] | None = None) -> None:
    config = service_config("worker", EngineConfig, argv, __doc__)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    run_worker(config, Addresses.from_env(), config.profile_dir)


if __name__ == "__main__":
    main()
