"""`stoker train-draft --method eagle` end to end: the folder it writes (config, the head's own
weights only, a model card with held-out acceptance) loads in `stoker serve`, the official
openai client gets the target's greedy text, and /metrics counts acceptance per position."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors import safe_open

from stoker.common.config import NGRAM_SPECULATIVE_TOKENS
from stoker.services.engine import LLM, SamplingParams
from tests.spec.eagle_heads import head_factory
from tests.spec.spec_models import SpecModels

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["To be, or not to be", "The quick brown fox", "Once upon a time there was"]


@pytest.fixture(scope="session")
def eagle_head(
    spec_models: Callable[[str], SpecModels], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    return head_factory(spec_models, tmp_path_factory)


def test_trained_folder_holds_the_head_and_its_card(eagle_head) -> None:
    head = eagle_head("llama", "trained")
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["EagleHead"]
    assert config["target_layers"] == [0, 1]  # a 2-layer target: low and high
    assert config["draft_vocab_size"] == 256  # train_head's reduced vocabulary
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t = f.get_tensor("d2t")
    assert "fuse" in names and "in_proj" in names
    assert d2t.dtype == torch.long and len(d2t.unique()) == 256  # the target ids it drafts
    assert not any("embed" in n and "norm" not in n for n in names), "the embedding is reused"
    assert "lm_head" not in names
    card = (head / "README.md").read_text()
    assert "stoker train-draft --method eagle" in card
    assert re.search(r"draft vocabulary \| 256 tokens, .* \(\d+\.\d% of held-out", card)
    assert re.search(r"mean accepted drafts per verify: \*\*\d+\.\d\d\*\*", card)
    # The head's own drafts, one share per position of its k (no n-gram matches mixed in).
    shares = re.search(r"accepting draft i, i = 1\.\.(\d+): (.*)$", card, re.M)
    assert shares is not None and len(shares.group(2).split(", ")) == int(shares.group(1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_eagle_head(
    spec_models: Callable[[str], SpecModels], eagle_head, tmp_path: Path
) -> None:
    target, head = spec_models("llama").target, eagle_head("llama", "trained")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.text for o in LLM(str(target), num_kv_blocks=128).generate(PROMPTS, params)]
    port = _free_port()
    cmd = [
        sys.executable, "-m", "stoker.cli", "serve",
        "--model", str(target), "--speculative-model", str(head),
        "--port", str(port), "--num-kv-blocks", "128", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115
    env = dict(os.environ, HF_HUB_OFFLINE="1", STOKER_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"stoker serve exited with {proc.returncode}:\n{log.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "/health not 200 within 120 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = [
            client.completions.create(
                model=model, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert got == want
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        per_pos = dict(
            re.findall(
                r'stoker:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d)"\} (\S+)',
                metrics,
            )
        )
        # The head drafts 4; with n-gram first (the default) a match may offer 8.
        positions = [str(j) for j in range(NGRAM_SPECULATIVE_TOKENS)]
        assert sorted(per_pos) == positions
        drafts = re.search(r"^stoker:spec_decode_num_draft_tokens_total (\S+)$", metrics, re.M)
        assert drafts is not None and float(drafts.group(1)) > 0
        accepted = re.search(r"^stoker:spec_decode_num_accepted_tokens_total (\S+)$", metrics, re.M)
        assert accepted is not None
        counts = [float(per_pos[j]) for j in positions]
        assert sum(counts) == float(accepted.group(1))
        assert counts == sorted(counts, reverse=True)  # draft j accepted only after j - 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            log.close()
