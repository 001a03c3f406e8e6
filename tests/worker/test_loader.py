"""Loading model folders: sharded weights, dtypes, and clear errors for bad folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from stoker.common.model_config import ModelLoadError
from stoker.services.engine import LLM, SamplingParams
from tests.factory import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
PROMPT = [5, 17, 33, 2, 9, 41]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("load") / "model", "qwen2")


def _hf_first_logprobs(path, dtype):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)


def test_sharded_checkpoint_with_index(folder, tmp_path):
    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(folder)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    want = LLM(folder, num_kv_blocks=16).generate([PROMPT], GREEDY)[0].token_ids
    assert LLM(sharded, num_kv_blocks=16).generate([PROMPT], GREEDY)[0].token_ids == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_transformers_at_a_tolerance(folder, dtype):
    torch_dtype = getattr(torch, dtype)
    out = LLM(folder, dtype=dtype, num_kv_blocks=16).generate([PROMPT], GREEDY)[0]
    assert len(out.token_ids) == 8
    ref = _hf_first_logprobs(folder, torch_dtype)
    first = out.logprobs[0]
    got = torch.tensor(first.top_logprobs)
    torch.testing.assert_close(got, ref[first.top_ids], rtol=0, atol=0.1)


def test_bfloat16_linears_are_packed_for_a_native_kernel_or_onednn(folder):
    """The pair kernel's layout on AVX512-BF16 CPUs, the panel kernel's on other AVX2 and
    AVX-512 ones, oneDNN's where STOKER_CPU_GEMM=onednn and the CPU has bfloat16 arithmetic."""
    from stoker.kernels import cpu_ops
    from stoker.services.worker.models.layers import linear

    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=16)
    model = llm.engine.runner.model
    weight = model.layers[0].mlp.gate_up_proj
    pairs, panels = cpu_ops.use_bf16_pairs(), cpu_ops.use_panel_linear()
    if not (pairs or panels or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        assert weight.dim() == 2 and not weight.is_mkldnn
        pytest.skip("no native kernel and no bfloat16 arithmetic: the linears stay plain")
    assert weight.dtype == torch.bfloat16
    if pairs:  # [N / 16, K / 2, 16, 2] back to [N, K]
        assert weight.dim() == 4
        dense = weight.permute(0, 2, 1, 3).reshape(16 * weight.shape[0], 2 * weight.shape[1])
    elif panels:  # [N / 16, K, 16] back to [N, K]
        assert weight.dim() == 3
        dense = weight.transpose(1, 2).reshape(16 * weight.shape[0], weight.shape[1])
    else:
        assert weight.is_mkldnn
        dense = weight.to_dense()
    x = torch.randn(5, dense.shape[1]).bfloat16()
    plain = torch.nn.functional.linear(x.float(), dense.float())
    torch.testing.assert_close(linear(x, weight).float(), plain, rtol=2e-2, atol=2e-2)


def test_bf16_checkpoint_served_in_float32_on_cpu(tmp_path):
    path = make_model(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    llm = LLM(path, num_kv_blocks=16)  # dtype auto: float32 on CPU
    assert llm.engine.runner.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :]
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == ref.tolist()


def test_missing_files_are_named(folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing \*\.safetensors weights, tokenizer\.json"):
        LLM(broken)
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(tmp_path / "nowhere")


def test_unsupported_architecture_is_named(folder, tmp_path):
    other = tmp_path / "gpt2ish"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(other)
