"""The wire protocol's digest, so that processes from different stoker builds refuse each other.

In compose or Kubernetes each process runs in its own container, and a rebuilt image may meet
an older one. Messages are array-like msgspec structs: a decoder drops trailing fields it does
not know and fills missing ones with defaults, so two builds whose messages differ would not
fail, they would quietly misbehave. Each handshake (SchedulerHello and WorkerReady between
scheduler and worker, SchedulerStats and TokenizerHeartbeat to the api) carries PROTOCOL, and a
peer with another one is refused with an error that says so. A peer from before this check
sends none (""), which never matches.

The digest covers every message's layout: field order, types and defaults (names and
docstrings are not on the wire and are left out). It changes by itself when a message does.
"""

from __future__ import annotations

import hashlib
import json
from types import ModuleType

import msgspec

from stoker.common import messages


def wire_digest(module: ModuleType) -> str:
    """A short hash of the wire schema of every msgspec Struct defined in `module`, with the
    structs and enums they contain."""
    structs = [
        obj
        for _, obj in sorted(vars(module).items())
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == module.__name__
    ]
    _, components = msgspec.json.schema_components(structs)
    text = json.dumps(_strip_prose(components), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _strip_prose(schema: object) -> object:
    if isinstance(schema, dict):
        return {k: _strip_prose(v) for k, v in schema.items() if k not in ("title", "description")}
    if isinstance(schema, list):
        return [_strip_prose(v) for v in schema]
    return schema


PROTOCOL = wire_digest(messages)


def check_peer(peer: str, protocol: str) -> str | None:
    """None when a peer speaks this build's protocol; otherwise the error to log and report."""
    if protocol == PROTOCOL:
        return None
    theirs = protocol or "none (a build from before the check)"
    return (
        f"the {peer} runs another stoker build: wire protocol {theirs}, this process's is "
        f"{PROTOCOL}. Run every process from one build (one image tag)."
    )
