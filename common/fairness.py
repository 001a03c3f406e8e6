"""Sharing one asyncio loop between a socket that is always busy and everything else.

A pyzmq asyncio recv (or send) on a socket that is ready completes without suspending, and
awaiting a finished future does not yield. So a loop that drains a busy socket keeps the event
loop to itself for as long as messages keep coming: under a sustained stream a tokenizer sent
no heartbeat for seconds (and the api then took it for dead and refused requests with 503),
and new requests waited behind the token stream. Each drain loop yields once per message.
"""

from __future__ import annotations

import asyncio


async def let_others_run() -> None:
    """One bare pass through the event loop: every other ready task runs before this resumes.
    Costs a few microseconds, paid per message (a step's batch), not per token."""
    await asyncio.sleep(0)
