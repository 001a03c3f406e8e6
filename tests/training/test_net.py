"""The lean training Llama computes exactly what transformers' LlamaForCausalLM computes."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from stoker.tools.training import net
from stoker.tools.training.model import LlamaSize, llama_config


def test_lean_llama_matches_transformers() -> None:
    size = LlamaSize(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2)
    config = llama_config(size, vocab_size=300, max_len=64, bos_id=1, eos_id=2, pad_id=0)
    lean = net.LeanLlama(config)
    lean.init_weights(seed=0)
    hf = LlamaForCausalLM(config).eval()
    result = hf.load_state_dict(net.to_hf_state_dict(lean), strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        torch.testing.assert_close(lean(ids), expected, rtol=1e-5, atol=1e-5)
        again = net.LeanLlama(config)
        net.from_hf_state_dict(again, hf.state_dict())
        torch.testing.assert_close(again(ids), expected, rtol=1e-5, atol=1e-5)
