"""The api process's settings; each field with a flag is a `python -m stoker.services.api` flag
(common/config_args.py). Light to import: `stoker serve` reads it for the flags."""

from __future__ import annotations

import dataclasses
import os

from stoker.common import model_registry
from stoker.common.config import MAX_MODEL_LEN, PROFILE_DIR, STEP_TIMEOUT_S
from stoker.common.config_args import flag
from stoker.common.tool_calls import FORMAT_NAMES
from stoker.services.api.openai_schema import DEFAULT_LIMITS, Limits
from stoker.services.api.request_log import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES

_LIMITS = "limits and access (docs/reliability.md)"
_REQUEST_LOG = "request log (docs/observability.md)"


@dataclasses.dataclass
class ApiConfig:
    """The api process's settings. Each field with a flag is a `python -m stoker.services.api` flag
    (common/config_args.py); `stoker serve` offers most of them too and hands them on."""

    model: str = flag(help="model name or path", required=True)
    host: str = flag("127.0.0.1")
    port: int = flag(8000)
    # None: the model's short or file name; the resolved name once constructed.
    served_model_name: str | None = flag(None, "default: the model's short or file name")
    max_request_bytes: int = flag(32 * 1024 * 1024)
    num_tokenizers: int = flag(1, "/health needs this many tokenizers up")
    # Accepted for symmetry with the other services; the tokenizers enforce the limit.
    max_model_len: int | None = MAX_MODEL_LEN.field()
    api_key: str | None = flag(  # None: no authentication
        None,
        "require `Authorization: Bearer KEY` (env STOKER_API_KEY; /health stays open)",
        env="STOKER_API_KEY",
        secret=True,
        group=_LIMITS,
    )
    protect_metrics: bool = flag(False, "/metrics needs the key too", switch=True, group=_LIMITS)
    max_n: int = flag(DEFAULT_LIMITS.max_n, "largest n (choices) per request", group=_LIMITS)
    max_queued_requests: int = flag(
        1024,
        "sub-requests waiting for their first token; past it new requests get 503",
        group=_LIMITS,
    )
    request_timeout_s: float | None = flag(  # None: no deadline
        None,
        "end a request that has not finished in this many seconds (default: no deadline)",
        group=_LIMITS,
    )
    shutdown_timeout: float = flag(
        30.0, "on SIGTERM, seconds in-flight requests may take to finish", group=_LIMITS
    )
    step_timeout_s: float = STEP_TIMEOUT_S.field(group=_LIMITS)
    log_requests: str | None = flag(
        None,
        "write one JSON line per finished choice (token ids, timings) to DIR",
        metavar="DIR",
        group=_REQUEST_LOG,
    )
    log_requests_text: bool = flag(
        False,
        "also log prompt and output text (left out by default)",
        switch=True,
        group=_REQUEST_LOG,
    )
    log_requests_max_bytes: int = flag(
        DEFAULT_MAX_BYTES,
        f"start a new file past this size (default {DEFAULT_MAX_BYTES >> 20} MiB)",
        group=_REQUEST_LOG,
    )
    log_requests_max_files: int = flag(
        DEFAULT_MAX_FILES,
        f"files kept in DIR; the oldest is deleted (default {DEFAULT_MAX_FILES})",
        group=_REQUEST_LOG,
    )
    # None: detected from the chat template (common/tool_calls/detect.py).
    tool_call_format: str | None = flag(
        None,
        "the tool-call format the model writes (default: detected from its chat template)",
        choices=FORMAT_NAMES,
    )
    profile_dir: str | None = PROFILE_DIR.field()  # /start_profile and /stop_profile are on
    limits: Limits = dataclasses.field(init=False)
    model_path: str = dataclasses.field(init=False)  # the model folder, for /tokenize

    def __post_init__(self) -> None:
        self.served_model_name = self.served_model_name or model_registry.served_model_name(
            self.model
        )
        self.api_key = self.api_key or None
        self.limits = Limits(max_n=self.max_n)
        self.model_path = str(model_registry.resolve_model(self.model))
        # Absolute, as the engine's: the same place whatever directory a process starts in.
        if self.profile_dir:
            self.profile_dir = os.path.abspath(self.profile_dir)
        if self.log_requests:
            self.log_requests = os.path.abspath(self.log_requests)
