"""GGUF loading: greedy output equals transformers loading the same file (`gguf_file=`), token for
token in float32, for every supported tensor type and architecture; the tokenizer, special tokens
and chat template come from the metadata; unsupported files get errors that name the problem."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from transformers import AutoTokenizer

from stoker.common.gguf_file import GGUFError, find_gguf
from stoker.common.model_config import ModelConfig, ModelLoadError
from stoker.common.tokenizer_files import load_tokenizer
from stoker.services.engine import LLM
from tests.engine.test_exactness import GREEDY, _hf_greedy
from tests.factory import make_model
from tests.gguf_factory import write_gguf

# (architecture, tensor type, extra config): every type on Llama (whose q/k rows llama.cpp
# permutes), a quantized type on each other architecture.
CASES = [
    ("llama", "F32", {}),
    ("llama", "F16", {}),
    ("llama", "BF16", {}),
    ("llama", "Q8_0", {}),
    ("llama", "Q4_0", {}),
    ("llama", "Q4_1", {"tie_word_embeddings": True}),
    ("qwen2", "Q4_1", {}),
    # transformers' GGUF path ignores attention.key_length (its Qwen3 default, 128, stands);
    # stoker reads it, so the reference only agrees where head_dim is 128.
    ("qwen3", "Q8_0", {"head_dim": 128}),
]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 19, 40)]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-src")
    return {
        (arch, tuple(sorted(extra.items()))): make_model(
            root / f"{arch}-{len(extra)}", arch, num_heads=4, num_kv_heads=2, **extra
        )
        for arch, _, extra in CASES
    }


@pytest.mark.parametrize(
    ("arch", "weight_type", "extra"), CASES, ids=[c[1] + "-" + c[0] for c in CASES]
)
def test_greedy_equals_transformers_on_the_same_file(
    hf_folders, tmp_path, arch, weight_type, extra
):
    folder = hf_folders[(arch, tuple(sorted(extra.items())))]
    path = write_gguf(folder, tmp_path / f"{arch}.{weight_type}.gguf", weight_type)
    prompts = _prompts(len(weight_type))
    llm = LLM(str(path), num_kv_blocks=64, block_size=8, max_num_batched_tokens=48)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == _hf_greedy(str(path.parent), prompts, gguf_file=path.name)
    blocks = llm.engine.block_manager
    blocks.check_invariants()
    assert blocks.num_free_blocks() == blocks.num_blocks


def test_tokenizer_and_chat_template_come_from_the_metadata(hf_folders, tmp_path):
    folder = hf_folders[("llama", ())]
    path = write_gguf(folder, tmp_path / "tok.gguf", "Q8_0")
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(folder))
    text = "To be, or not to be — héllo wörld 🚀 def add(a, b): return a + b"
    assert ours.encode(text) == theirs.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and?"},
    ]
    for add in (True, False):
        assert ours.apply_chat_template(chat, add_generation_prompt=add) == (
            theirs.apply_chat_template(chat, add_generation_prompt=add)
        )
    cfg = ModelConfig.from_folder(path)
    assert (cfg.eos_token_ids, cfg.bos_token_id) == ((2,), 1)
    # The offline engine uses the same tokenizer: a text prompt gives the same ids.
    out = LLM(str(path), num_kv_blocks=16).generate(["To be, or not"], GREEDY)[0]
    assert out.prompt_token_ids == theirs.encode("To be, or not")


def test_a_folder_holding_one_gguf_loads_like_the_file(hf_folders, tmp_path):
    folder = hf_folders[("qwen2", ())]
    holder = tmp_path / "holder"
    holder.mkdir()
    path = write_gguf(folder, holder / "model.Q8_0.gguf", "Q8_0")
    assert find_gguf(holder) == path
    prompts = _prompts(3)
    want = [o.token_ids for o in LLM(str(path), num_kv_blocks=32).generate(prompts, GREEDY)]
    got = [o.token_ids for o in LLM(str(holder), num_kv_blocks=32).generate(prompts, GREEDY)]
    assert got == want
    shutil.copy(path, holder / "second.gguf")
    with pytest.raises(GGUFError, match="2 .gguf files"):
        find_gguf(holder)


def test_unsupported_tensor_type_is_named(hf_folders, tmp_path):
    folder = hf_folders[("llama", ())]
    path = write_gguf(folder, tmp_path / "q5.gguf", "Q5_0")
    with pytest.raises(
        ModelLoadError, match=r"Q5_0; stoker reads F32, F16, BF16, Q8_0, Q4_0, Q4_1"
    ):
        LLM(str(path), num_kv_blocks=16)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    values = np.zeros((4, 32), dtype=np.float32)
    writer.add_tensor("token_embd.weight", quants.quantize(values, GGMLQuantizationType.F32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'falcon'.*not supported"):
        ModelConfig.from_folder(path)


def test_missing_and_foreign_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "absent.gguf"), num_kv_blocks=16)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        ModelConfig.from_folder(bad)
