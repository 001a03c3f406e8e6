"""compose.yaml in real containers: the image built by scripts/build-image.sh, the service set
run by podman-compose. Up, the official openai client through the published port (streamed and
not), --scale tokenizer=3 with requests spread over all three, kill and restart of a tokenizer,
the worker, the scheduler and the api (podman brings back no killed container, so the test
restarts it as a supervisor would), in-flight requests ending with an error rather than a hang,
and down, cleaning up by the project label. Skips only where podman cannot run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.deploy.procs import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOCAL_BASE = "localhost/debian-python:bookworm"  # /work/shared/peers/containers/setup.sh
COMPOSE_VENV = Path(os.environ.get("TMPDIR", "/tmp")) / "podman-compose-venv/bin/podman-compose"
MODEL = os.environ.get("STOKER_TEST_COMPOSE_MODEL", "smollm2")  # compose's default model
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}


def _podman_problem() -> str | None:
    if not shutil.which("podman"):
        return "podman is not installed (see docs/deploy.md: Podman)"
    try:
        info = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "`podman info` did not answer within 60 s"
    if info.returncode != 0:
        return f"podman cannot run here: {(info.stderr.strip().splitlines() or ['?'])[-1]}"
    if not (shutil.which("podman-compose") or COMPOSE_VENV.exists()):
        return "podman-compose is not installed"
    return None


PROBLEM = _podman_problem()
if PROBLEM:
    pytestmark = [pytest.mark.slow, pytest.mark.skip(reason=PROBLEM)]


def _run(cmd: list[str], timeout: float = 600, env: dict | None = None, check: bool = True):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check and done.returncode != 0:
        raise AssertionError(f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def _base_image() -> str:
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    local = subprocess.run(["podman", "image", "exists", LOCAL_BASE]).returncode == 0
    return LOCAL_BASE if local else "python:3.11-slim"


@pytest.fixture(scope="module")
def image() -> str:
    env = dict(os.environ, BASE_IMAGE=_base_image(), CONTAINER_ENGINE="podman")
    start = time.monotonic()
    _run([str(REPO / "scripts/build-image.sh")], timeout=1800, env=env)
    print(f"\nimage build: {time.monotonic() - start:.1f} s")
    user = _run(["podman", "run", "--rm", "stoker:latest", "id", "-u"]).stdout.strip()
    assert user != "0", "the image must run as a non-root user"
    return "stoker:latest"


class Stack:
    """One podman-compose project, named uniquely so the cleanup by label is exact."""

    def __init__(self) -> None:
        self.project = f"stoker-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tool = shutil.which("podman-compose") or str(COMPOSE_VENV)
        self.cmd = [tool, "-p", self.project, "-f", str(REPO / "compose.yaml")]
        self.env = dict(os.environ, STOKER_PORT=str(self.port), STOKER_MODEL=MODEL)

    def compose(self, *args: str) -> subprocess.CompletedProcess:
        return _run([*self.cmd, *args], env=self.env)

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        cmd = ["podman", "ps", "--format", "{{.Names}}"]
        cmd += ["--filter", f"label=io.podman.compose.project={self.project}"]
        if service:
            cmd += ["--filter", f"label=com.docker.compose.service={service}"]
        if all_states:
            cmd.append("-a")
        return sorted(_run(cmd).stdout.split())

    def networks(self) -> list[str]:
        cmd = ["podman", "network", "ls", "--format", "{{.Name}}"]
        cmd += ["--filter", f"label=io.podman.compose.project={self.project}"]
        return _run(cmd).stdout.split()

    def remove_all(self) -> None:
        names = self.containers(all_states=True)
        if names:
            _run(["podman", "rm", "-f", "-t", "2", *names], check=False)
        for net in self.networks():
            _run(["podman", "network", "rm", "-f", net], check=False)


@pytest.fixture(scope="module")
def stack(image):
    s = Stack()
    try:
        yield s
    finally:
        logs = {n: _run(["podman", "logs", "--tail", "15", n], check=False) for n in s.containers()}
        for name, out in logs.items():
            print(f"--- {name}\n{out.stdout[-1500:]}{out.stderr[-1500:]}")
        s.remove_all()


def _serves(url: str, timeout: float = 180.0) -> float:
    """Seconds until a completion answers 200; 503s (with Retry-After) and connection errors
    meanwhile are what a client sees while the set heals, and it retries."""
    start = time.monotonic()
    while True:
        try:
            r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] >= 1
                return time.monotonic() - start
            assert r.status_code == 503, r.text
        except httpx.TransportError:
            pass
        assert time.monotonic() - start < timeout, f"{url} did not serve within {timeout} s"
        time.sleep(0.5)


def _per_tokenizer(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = r'^stoker:tokenizer_requests_total\{tokenizer="([^"]+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


class InFlight(threading.Thread):
    """A long stream, read line by line: how it ended, and whether it ended at all."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.started, self.ending = url, threading.Event(), None

    def run(self) -> None:
        body = {**BODY, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    self.ending = f"status {r.status_code}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.ending = "error event"
                        self.started.set()
                    elif line == "data: [DONE]":
                        self.ending = self.ending or "done without error"
        except httpx.TransportError as e:
            self.ending = f"connection closed ({type(e).__name__})"
        finally:
            self.started.set()


def test_compose_up_scale_heal_down(stack):
    from openai import OpenAI

    start = time.monotonic()
    stack.compose("up", "-d")
    assert stack.containers() and len(stack.containers()) == 4, stack.containers()
    _serves(stack.url, timeout=300)
    print(f"\ncompose up -> first answer: {time.monotonic() - start:.1f} s")
    ports = _run(["podman", "ps", "--format", "{{.Names}} {{.Ports}}"]).stdout
    published = [ln for ln in ports.splitlines() if ln.startswith(stack.project)]
    assert not any(re.search(r":560[1-5]->", ln) for ln in published), published

    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=3)
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    assert reply.choices[0].text and reply.usage.completion_tokens == 8
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()

    # Scale the tokenizer to 3: nothing else changes, and requests reach all three.
    stack.compose("up", "-d", "--scale", "tokenizer=3")
    assert len(stack.containers("tokenizer")) == 3
    deadline = time.monotonic() + 180
    while len([n for n in _per_tokenizer(stack.url).values() if n > 0]) < 3:
        assert time.monotonic() < deadline, _per_tokenizer(stack.url)
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    print(f"per-tokenizer requests: {_per_tokenizer(stack.url)}")

    # Kill or restart each kind of container: in-flight requests end (with an error), never
    # hang, and the set serves again once the container is back.
    for service, action in [
        ("tokenizer", "kill"),
        ("worker", "kill"),
        ("worker", "restart"),
        ("scheduler", "restart"),
        ("api", "kill"),
    ]:
        name = stack.containers(service)[0]
        flight = InFlight(stack.url)
        flight.start()
        assert flight.started.wait(120), "the stream never started"
        t0 = time.monotonic()
        if action == "kill":
            _run(["podman", "kill", name])
            if service == "tokenizer":  # the other two keep serving meanwhile
                assert _serves(stack.url, timeout=30) < 30
            _run(["podman", "start", name])
        else:
            _run(["podman", "restart", "-t", "5", name])
        flight.join(120)
        assert not flight.is_alive(), f"{service} {action}: the in-flight stream hung"
        if service != "tokenizer":  # (a stream on one of the other two tokenizers runs on)
            assert flight.ending != "done without error", f"{service} {action}: {flight.ending}"
        _serves(stack.url)
        print(
            f"{service} {action}: stream ended by {flight.ending}; served again after "
            f"{time.monotonic() - t0:.1f} s"
        )
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens == 4

    # Down: the project's own containers and network go; scaled replicas that podman-compose
    # leaves are removed by the project label, and nothing is left after that.
    stack.compose("down", "-t", "5")
    left = stack.containers(all_states=True)
    print(f"left by podman-compose down: {left}")
    assert all(re.search(r"_tokenizer_[0-9]+$", n) for n in left), left
    stack.remove_all()
    assert stack.containers(all_states=True) == [] and stack.networks() == []


def test_cuda_variant_switch_is_parsed(image):
    """The CUDA variant's Dockerfile steps, as far as they run without CUDA wheels: the build
    argument selects the CUDA torch, and an offline build without its wheel stops with a clear
    message at the dependency step (the base stage, cached, builds)."""
    done = _run(
        [
            "podman",
            "build",
            "--build-arg",
            f"BASE_IMAGE={_base_image()}",
            "--build-arg",
            "TORCH_VARIANT=cu128",
            "--target",
            "deps",
            "-t",
            "stoker-cuda-check",
            ".",
        ],
        check=False,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "no torch==2.13.0+cu128 wheel in the wheelhouse" in out, out[-3000:]
    script = _run(
        [str(REPO / "scripts/build-image.sh")],
        check=False,
        env=dict(
            os.environ, TORCH_VARIANT="cu128", CONTAINER_ENGINE="podman", BASE_IMAGE=_base_image()
        ),
    )
    assert script.returncode != 0 and "TORCH_WHEEL" in script.stderr
