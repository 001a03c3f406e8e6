"""`pip install .` (not editable) into a fresh venv: `stoker generate` and `stoker serve` run from
another directory with no PYTHONPATH, import the installed package (not this checkout), and
find the bundled models inside it (docs/architecture.md, "Package layout").

The venv borrows the test venv's dependencies through a .pth file (a full install would fetch
torch again); the stoker package itself is built and installed as a user's pip would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from openai import OpenAI

from tests.deploy.procs import children_of, free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    site = next((root / "lib").glob("python3*/site-packages"))
    (site / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(REPO)]
    subprocess.run(pip, check=True, timeout=600)
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return {**env, "HF_HUB_OFFLINE": "1", "STOKER_MODEL_CACHE": "/nonexistent-stoker-cache"}


def test_the_installed_package_is_imported_from_any_directory(venv, tmp_path):
    code = "import stoker.services, stoker.models as m; print(stoker.services.__file__, m.__file__)"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert all(path.startswith(str(venv)) for path in out), out
    assert (Path(out[1]).parent / "stoker-tiny" / "model.safetensors").is_file()


def test_generate_runs_from_another_directory(venv, tmp_path):
    cmd = [str(venv / "bin" / "stoker"), "generate", "Once upon a time", "--max-tokens", "6"]
    cmd += ["--model", "stoker-tiny"]
    done = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--- 'Once upon a time' (length)" in done.stdout


def test_serve_runs_from_another_directory_and_stops_on_sigint(venv, tmp_path):
    port = free_port()
    cmd = [str(venv / "bin" / "stoker"), "serve", "--model", "stoker-tiny", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", timeout=300, procs=[proc])
        kids = children_of(proc.pid)
        for pid in kids:  # every process runs the installed package
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert args[0].startswith(str(venv).encode()) and b"-P" in args, args
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        reply = client.completions.create(
            model="stoker-tiny", prompt="Once upon", max_tokens=5, temperature=0.0
        )
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not [pid for pid in kids if Path(f"/proc/{pid}").exists()]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
