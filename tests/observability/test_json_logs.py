"""--log-format json (issue 12): every process of a real `stoker serve` writes one JSON object
per line, and the lines about a request carry its id; the formatters, unit-tested alone."""

from __future__ import annotations

import json
import logging
import sys

import httpx
import pytest

from stoker.common.logs import JsonFormatter, TextFormatter, configure_logging
from tests.factory import make_model
from tests.reliability.serve import Served


def _record(msg: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord("stoker.test", logging.INFO, __file__, 1, msg, (), None)
    record.__dict__.update(extra)
    return record


def test_json_lines_carry_the_request_id_and_the_traceback() -> None:
    fmt = JsonFormatter("api")
    line = json.loads(fmt.format(_record("finished", request_id="cmpl-1-0")))
    assert line["service"] == "api" and line["level"] == "INFO"
    assert line["message"] == "finished" and line["request_id"] == "cmpl-1-0"
    assert line["time"].endswith("Z") and line["logger"] == "stoker.test"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record("failed", request_ids=["a", "b"])
        record.exc_info = sys.exc_info()
    line = json.loads(fmt.format(record))
    assert line["request_ids"] == ["a", "b"] and "RuntimeError: boom" in line["exception"]


def test_text_lines_end_with_the_request_id() -> None:
    assert (
        TextFormatter()
        .format(_record("finished", request_id="r-1"))
        .endswith("INFO stoker.test finished [request r-1]")
    )
    assert TextFormatter().format(_record("plain")).endswith("INFO stoker.test plain")


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log-format"):
        configure_logging("api", "xml")


def test_every_process_logs_json_with_request_ids(tmp_path) -> None:
    model = make_model(tmp_path / "m", "llama")
    server = Served(
        model, tmp_path / "run", tmp_path / "serve.log", "--log-format", "json",
        STOKER_LOG_LEVEL="DEBUG",
    )  # fmt: skip
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
        done = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        # A client that goes away mid-stream: the api and the scheduler log its abort.
        stream = {"prompt": [8, 9], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    gone = json.loads(line[len("data: ") :])["id"]
                    break
        server.wait_blocks_free()
    finally:
        server.stop()
    lines = [json.loads(raw) for raw in server.logs().splitlines() if raw.strip()]  # all parse
    services = {line["service"] for line in lines}
    assert {"launcher", "api", "tokenizer", "scheduler", "worker"} <= services

    def services_naming(api_id: str) -> set[str]:
        named = set()
        for line in lines:
            ids = line.get("request_ids") or [line.get("request_id") or ""]
            if any(i.startswith(api_id) for i in ids):
                named.add(line["service"])
        return named

    assert {"api", "tokenizer", "scheduler"} <= services_naming(done["id"])
    assert {"api", "scheduler"} <= services_naming(gone)
    assert any(line["service"] == "launcher" and "serving" in line["message"] for line in lines)
