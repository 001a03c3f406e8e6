"""One real `stoker serve` for tests/clients, on a tiny random-init model whose chat template is
Qwen2.5's (hermes tool calls), behind a capturing proxy: every client library under test talks
real HTTP to the proxy, which records each request body and the status the server gave it."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

from tests.clients import capture_payloads
from tests.factory import make_model, make_tokenizer
from tests.tool_calls.templates import QWEN25

# litellm fetches its model cost map over the network at import; offline that is ~10 s of retries.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-qwen"
NUM_KV_BLOCKS = 512
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
STARTUP_TIMEOUT_S = 240.0  # ~5 s when idle; minutes on this shared 2-core box under load
# Qwen2.5's markers: the chat tags are special tokens, the tool-call tags added (not special)
# tokens, as in Qwen's tokenizer.json.
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 640  # covers the 512 trained tokens plus the added ones


def make_qwen_like_model(path: Path) -> Path:
    """A random-init qwen2 model with a tokenizer that has Qwen2.5's template and markers; its
    eos is <|im_end|>, so a grammar's end is the model's stop, as on the real model."""
    tok: PreTrainedTokenizerFast = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tok.add_tokens(TOOL_TOKENS)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN25
    assert len(tok) <= VOCAB_SIZE
    make_model(
        path,
        "qwen2",
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_MODEL_LEN,
        with_tokenizer=False,
    )
    tok.save_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.exists():
            cfg = json.loads(file.read_text())
            cfg["eos_token_id"] = eos
            file.write_text(json.dumps(cfg, indent=2))
    return path


@dataclasses.dataclass
class Exchange:
    """One request through the proxy: what the client sent and the status it got back."""

    label: str
    method: str
    path: str
    body: bytes
    status: int = 0


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client dropping a kept-alive connection is normal; anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class CapturingProxy:
    """A small threaded HTTP/1.1 proxy that forwards to the server byte for byte (streamed
    responses chunk by chunk) and records every exchange under the label set by `label()`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[Exchange] = []
        self._label = ""
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy._forward(self)

            def do_POST(self) -> None:
                proxy._forward(self)

        self._http = httpx.Client(base_url=upstream, timeout=120)
        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def label(self, label: str) -> None:
        with self._lock:
            self._label = label

    def _forward(self, h: http.server.BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        with self._lock:
            ex = Exchange(self._label, h.command, h.path, body)
            self.exchanges.append(ex)
        skip = {"host", "content-length", "connection", "accept-encoding"}
        headers = {k: v for k, v in h.headers.items() if k.lower() not in skip}
        req = self._http.build_request(h.command, h.path, content=body, headers=headers)
        resp = self._http.send(req, stream=True)
        try:
            self._relay(h, resp, ex)
        except ConnectionError:
            pass  # the client stopped reading (it had what it wanted): not the server's doing
        finally:
            resp.close()

    @staticmethod
    def _relay(h: http.server.BaseHTTPRequestHandler, resp: httpx.Response, ex: Exchange) -> None:
        ex.status = resp.status_code
        h.send_response(resp.status_code)
        for k, v in resp.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                h.send_header(k, v)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for chunk in resp.iter_raw():
            if chunk:
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                h.wfile.flush()
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()


@dataclasses.dataclass
class StokerServer:
    url: str
    model_path: Path
    proc: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def scheduler_state(self) -> dict:
        return httpx.get(f"{self.url}/debug/state", timeout=5).json()["scheduler"]

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Poll until nothing runs or waits and every KV block is free; return the last state."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.scheduler_state()
            idle = s["num_running"] == 0 and s["num_waiting"] == 0
            if (idle and s["num_free_blocks"] == s["num_total_blocks"]) or (
                time.monotonic() > deadline
            ):
                return s
            time.sleep(0.05)

    def error_lines(self) -> list[str]:
        """Log lines of server-side failures: a 500 (unhandled error), a stream that failed
        after its 200, a traceback. The api keeps no access log, so these are the 5xx trail."""
        pattern = re.compile(r" (ERROR|CRITICAL) |Traceback|unhandled error|stream failed")
        return [ln for ln in self.log_path.read_text().splitlines() if pattern.search(ln)]


def _descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc). The launcher starts its services in sessions of
    their own, so a launcher killed before it could stop them would leave them running."""
    out: list[int] = []
    todo = [pid]
    while todo:
        try:
            children = Path(f"/proc/{todo.pop()}/task").glob("*/children")
            found = [int(c) for f in children for c in f.read_text().split()]
        except OSError:
            continue
        out += found
        todo += found
    return out


def _stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM the launcher (it stops its services); past 30 s, SIGKILL it and each service."""
    children = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def stoker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StokerServer]:
    model = make_qwen_like_model(tmp_path_factory.mktemp("clients") / MODEL_NAME)
    port = _free_port()
    log_path = tmp_path_factory.mktemp("clients-logs") / "serve.log"
    cmd = [
        sys.executable, "-m", "stoker.cli", "serve",
        "--model", str(model),
        "--served-model-name", MODEL_NAME,
        "--port", str(port),
        "--tokenizers", "1",
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--run-dir", str(tmp_path_factory.mktemp("clients-run")),
    ]  # fmt: skip
    log = open(log_path, "w+")  # noqa: SIM115 (closed at teardown)
    env = dict(os.environ, HF_HUB_OFFLINE="1", STOKER_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"stoker serve exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"/health not 200 within {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()}")
        time.sleep(0.2)
    yield StokerServer(url, model, proc, log_path)

    code = _stop(proc)
    log.close()
    assert code == 0, f"stoker serve exited with {code} (None: killed after 30 s)"


@pytest.fixture(scope="session")
def proxy(stoker_server: StokerServer) -> Iterator[CapturingProxy]:
    p = CapturingProxy(stoker_server.url)
    yield p
    p.close()
    if out := os.environ.get(capture_payloads.ENV):  # capture_payloads.py regenerates the pins
        capture_payloads.write(p.exchanges, Path(out))
