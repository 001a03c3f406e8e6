"""Where each process binds and connects. One place, so every service agrees.

Topology (who binds is chosen so that tokenizers can be scaled without reconfiguring anyone):
- api binds `api_inbound` (PULL): TextBatch and heartbeats from tokenizers.
- api binds `tokenizer_requests` (PUSH): TokenizeRequests, round-robined by ZMQ over the connected
  tokenizers.
- scheduler binds `scheduler` (ROUTER): tokenizers and the api connect DEALER sockets with their
  own routing id; the scheduler receives GenerateRequest/Abort there and replies to the owning
  tokenizer (TokenBatch) or to the api (SchedulerStats) by routing id.
- scheduler binds `worker_plan` (PUSH) and `worker_result` (PULL); the worker connects both.

Defaults are ipc:// sockets in a run directory; containers use tcp:// from the environment.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tempfile
from pathlib import Path

ENV_PREFIX = "STOKER_"
API_ROUTING_ID = b"api"


@dataclasses.dataclass(frozen=True)
class Addresses:
    api_inbound: str
    tokenizer_requests: str
    scheduler: str
    worker_plan: str
    worker_result: str

    @classmethod
    def in_run_dir(cls, run_dir: str | Path) -> Addresses:
        d = Path(run_dir)
        return cls(**{f.name: f"ipc://{d / f.name}.sock" for f in dataclasses.fields(cls)})

    @classmethod
    def from_env(cls, run_dir: str | Path | None = None) -> Addresses:
        """Each address from STOKER_<NAME> (e.g. STOKER_SCHEDULER), else the run dir's ipc path."""
        run_dir = run_dir or os.environ.get("STOKER_RUN_DIR") or default_run_dir()
        base = cls.in_run_dir(run_dir)
        overrides = {
            f.name: os.environ[ENV_PREFIX + f.name.upper()]
            for f in dataclasses.fields(cls)
            if ENV_PREFIX + f.name.upper() in os.environ
        }
        return dataclasses.replace(base, **overrides)

    def to_env(self) -> dict[str, str]:
        return {ENV_PREFIX + k.upper(): v for k, v in dataclasses.asdict(self).items()}


def default_run_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"stoker-{os.getuid()}")


def private_dir(path: str | Path) -> Path:
    """Create path 0700, or check an existing one: a real directory (not a symlink), owned by
    this user and closed to others. In a shared /tmp another user could otherwise pre-create
    the run directory and read or hijack the sockets."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"run directory {p} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"run directory {p} is owned by uid {st.st_uid}, not by us")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"run directory {p} is open to other users (mode {st.st_mode & 0o777:o}); "
            "it must be 0700"
        )
    return p


def bind_address(address: str) -> str:
    """tcp://name:port -> tcp://*:port for the binding side; ipc paths need a private
    directory."""
    if address.startswith("tcp://"):
        _, port = address[len("tcp://") :].rsplit(":", 1)
        return f"tcp://*:{port}"
    if address.startswith("ipc://"):
        private_dir(Path(address[len("ipc://") :]).parent)
    return address
