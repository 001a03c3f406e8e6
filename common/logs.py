"""Process-wide logging set-up, one call per process: plain text for people, or JSON lines
(`--log-format json`, or STOKER_LOG_FORMAT=json, which `stoker serve` passes to its children)
for a log pipeline. A record about one request carries it as `extra={"request_id": ...}` (or
`request_ids` for several); the JSON line then has it as a field, and the text line ends with it.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import traceback
from types import TracebackType

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
REQUEST_FIELDS = ("request_id", "request_ids")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        entry: dict[str, object] = {
            "time": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in REQUEST_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [getattr(record, key, None) for key in REQUEST_FIELDS]
        ids = [i for i in ids if i is not None]
        return f"{line} [request {ids[0]}]" if ids else line


def add_log_format_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("STOKER_LOG_FORMAT", "text"),
        help="text, or json: one JSON object per line, with request ids where they apply",
    )


def configure_logging(
    service: str, log_format: str | None = None, level: str | None = None
) -> None:
    """Replace the root handlers with one stderr handler in the chosen format. In JSON mode,
    warnings and uncaught exceptions are logged too, so every line a process writes parses."""
    log_format = log_format or os.environ.get("STOKER_LOG_FORMAT", "text")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {LOG_FORMATS}, not {log_format!r}")
    level = (level or os.environ.get("STOKER_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if log_format == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
    # `kill -USR2 <pid>` prints every thread's Python stack to stderr, even while the main
    # thread is blocked in C (a stuck socket call, a hung exit): the first thing to look at.
    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, all_threads=True)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("stoker").critical(
        "uncaught exception: %s",
        "".join(traceback.format_exception_only(kind, exc)).strip(),
        exc_info=(kind, exc, tb),
    )
