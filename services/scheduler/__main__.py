"""`python -m services.scheduler [engine flags]`: the scheduler process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import uvloop

from common.addresses import Addresses
from common.logs import add_log_format_arg, configure_logging
from common.shutdown import destroy_context_within, exit_on_sigterm, stop_within
from services.engine_args import add_engine_args, engine_config_from_args
from services.scheduler.service import EXIT_STALLED, EngineStalled, SchedulerService

log = logging.getLogger("stoker.scheduler")


async def _serve(service: SchedulerService) -> None:
    # SIGTERM through the loop: a plain Python handler may not run while uvloop sits in
    # epoll_wait with nothing else due, and the process then ignores SIGTERM.
    task = asyncio.current_task()
    assert task is not None

    def on_sigterm() -> None:
        stop_within()
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await service.run()
    except asyncio.CancelledError:
        log.info("SIGTERM: scheduler stopping")
    except EngineStalled as e:
        service._fail_all(str(e))  # inside the loop: the router is an asyncio socket
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stoker scheduler", description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--no-overlap", action="store_true", help="one step in flight at a time")
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=60.0,
        help="no step result for this long: fail every request and exit 3",
    )
    add_log_format_arg(parser)
    args = parser.parse_args(argv)
    configure_logging("scheduler", args.log_format)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    service = SchedulerService(
        engine_config_from_args(args),
        Addresses.from_env(),
        overlap=not args.no_overlap,
        step_timeout_s=args.step_timeout_s,
        profile_dir=args.profile_dir,
    )
    try:
        uvloop.run(_serve(service))
    except EngineStalled as e:
        # Exit so a supervisor (stoker serve, compose) acts; a restarted scheduler handshakes
        # with the worker afresh. The linger lets the failures reach the api and tokenizers;
        # the context's term is bounded (it can hang on the stalled worker's pipe), and
        # os._exit keeps the exit code whatever is left.
        log.error("%s: exiting", e)
        service.profiler.stop()
        if not destroy_context_within(service.ctx, linger_ms=1000, seconds=3.0):
            log.warning("the ZMQ context did not close within 3 s; exiting regardless")
        logging.shutdown()
        os._exit(EXIT_STALLED)
    finally:
        service.profiler.stop()  # a trace in progress is still written on SIGTERM
        # A bounded linger: the default (forever) makes exit hang on messages queued for an
        # api or tokenizer that stopped first.
        service.ctx.destroy(linger=500)


if __name__ == "__main__":
    main()
