"""One real server (launcher, api, 2 tokenizers, scheduler, worker) for the whole session, on a
random-init tiny model, plus the offline LLM on the same folder to compare outputs with."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.factory import make_model

REPO = Path(__file__).resolve().parents[2]
NUM_KV_BLOCKS = 512
BLOCK_SIZE = 16
STARTUP_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    model_path: Path
    model_name: str
    proc: subprocess.Popen
    num_kv_blocks: int = NUM_KV_BLOCKS
    block_size: int = BLOCK_SIZE

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def state(self) -> dict:
        return httpx.get(f"{self.url}/debug/state", timeout=5).json()["scheduler"]

    def wait_idle(self, timeout: float = 1.0) -> dict:
        """Poll until nothing runs or waits and every KV block is free; return the last state."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            idle = s["num_running"] == 0 and s["num_waiting"] == 0
            if idle and s["num_free_blocks"] == s["num_total_blocks"]:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    """Every process below pid (Linux /proc), to check that teardown leaves none behind."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for c in map(int, children):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("services") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def server(model_path: Path, tmp_path_factory) -> Server:
    port = _free_port()
    run_dir = tmp_path_factory.mktemp("run")
    cmd = [
        sys.executable, "-m", "stoker.cli", "serve",
        "--model", str(model_path),
        "--port", str(port),
        "--tokenizers", "2",
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "512",
        "--max-request-bytes", str(1 << 20),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    log = open(tmp_path_factory.mktemp("logs") / "serve.log", "w+")  # noqa: SIM115
    env = dict(os.environ, HF_HUB_OFFLINE="1", STOKER_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"stoker serve exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"/health not 200 within {STARTUP_TIMEOUT_S}s:\n{log.read()}")
        time.sleep(0.2)
    children = _descendants(proc.pid)
    yield Server(url, model_path, model_path.name, proc)

    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        log.close()
    assert code == 0, f"stoker serve exited with {code}"
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)], "child processes outlived the launcher"


@pytest.fixture(scope="session")
def llm(model_path: Path):
    from stoker.services.engine import LLM

    return LLM(str(model_path), num_kv_blocks=128, block_size=BLOCK_SIZE, max_model_len=512)
