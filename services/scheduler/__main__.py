"""`python -m stoker.services.scheduler [engine flags]`: the scheduler process."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING

from stoker.common.addresses import Addresses
from stoker.common.config_args import service_config
from stoker.common.shutdown import destroy_context_within, exit_on_sigterm, stop_within
from stoker.services.scheduler.config import SchedulerServiceConfig

if TYPE_CHECKING:
    from stoker.services.scheduler.service import SchedulerService

log = logging.getLogger("stoker.scheduler")


async def _serve(service: SchedulerService) -> None:
    # SIGTERM through the loop: a plain Python handler may not run while uvloop sits in
    # epoll_wait with nothing else due, and the process then ignores SIGTERM.
    from stoker.services.scheduler.worker_link import EngineStalled

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
    config = service_config("scheduler", SchedulerServiceConfig, argv, __doc__)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    import uvloop

    from stoker.services.scheduler.service import EXIT_STALLED, SchedulerService
    from stoker.services.scheduler.worker_link import EngineStalled

    service = SchedulerService(
        config.engine,
        Addresses.from_env(),
        overlap=not config.no_overlap,
        step_timeout_s=config.step_timeout_s,
        profile_dir=config.engine.profile_dir,
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
